"""The detokenization bench on SmolLM2's real tokenizer, on a short stream: the result has every
field, the stream released exactly what decoding all the tokens at once gives, and the ids
decoded per token stay flat for the stream and grow the old way. Times are not asserted: the
benchmark reports them."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from raykv.bench.detokenize import (
    SAMPLE_TEXT,
    default_stops,
    long_token_ids,
    run_detokenize_bench,
)
from raykv.serve.protocol import MAX_STOP_CHARS

FIELDS = {
    "num_tokens",
    "first_window_us_per_token",
    "last_window_us_per_token",
    "ratio",
    "first_window_decoded_ids_per_token",
    "last_window_decoded_ids_per_token",
    "total_s",
}


class HfTokenizer:
    """transformers' tokenizer called as raykv's ``Tokenizer`` calls it."""

    def __init__(self, hf) -> None:
        self.hf = hf

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=True)


def test_the_bench_streams_the_same_text_at_a_flat_cost_per_token(smollm2_hf_tokenizer) -> None:
    tokenizer = HfTokenizer(smollm2_hf_tokenizer)
    assert len(tokenizer.encode(SAMPLE_TEXT)) < 600  # so 1,200 tokens repeat it
    result = run_detokenize_bench(tokenizer, num_tokens=1_200, window=200, whole_decode_tokens=600)
    assert result["same_text"] is True
    assert result["num_tokens"] == 1_200 and result["window"] == 200
    assert result["characters"] == len(tokenizer.decode(long_token_ids(tokenizer, 1_200)))
    assert (
        result["stops"] == [len(s) for s in default_stops()] and MAX_STOP_CHARS in result["stops"]
    )
    incremental, whole = result["incremental"], result["whole_decode"]
    assert set(incremental) == set(whole) == FIELDS
    assert incremental["num_tokens"] == 1_200 and whole["num_tokens"] == 600
    assert all(part[key] > 0 for part in (incremental, whole) for key in FIELDS)
    # exact counts, no clock: a few ids a token for the stream wherever it is, the old way each
    # push decoding all tokens so far (the window's positions: 1..200 and 401..600 on average)
    assert incremental["last_window_decoded_ids_per_token"] <= 8
    assert incremental["first_window_decoded_ids_per_token"] <= 8
    assert whole["first_window_decoded_ids_per_token"] == pytest.approx(100.5)
    assert whole["last_window_decoded_ids_per_token"] == pytest.approx(500.5)


def test_the_bench_refuses_windows_that_do_not_fit(smollm2_hf_tokenizer) -> None:
    tokenizer = HfTokenizer(smollm2_hf_tokenizer)
    with pytest.raises(ValueError, match="two windows"):
        run_detokenize_bench(tokenizer, num_tokens=300, window=200, whole_decode_tokens=400)
    with pytest.raises(ValueError, match="prefix"):
        run_detokenize_bench(tokenizer, num_tokens=400, window=100, whole_decode_tokens=800)
