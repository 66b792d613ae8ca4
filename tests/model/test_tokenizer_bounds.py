"""``Tokenizer.min_tokens`` (issue 28, finding 4), the length check that refuses a prompt too
long for the context without encoding it: it must never exceed what encoding gives, on
SmolLM2's byte-level tokenizer and on a Llama-style SentencePiece one (built in memory), for
texts of every kind, whitespace runs and special tokens included; and ``token_bytes`` gives each
token's own bytes, which join into the text's UTF-8."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("transformers")

from raykv.model.tokenizer import Tokenizer, _shrink
from tests.serve.test_text_stream import llama_style_tokenizer

PIECES = [
    *"abc xyz",
    "  ",
    "\n",
    "\t",
    "é",
    "日本",
    "😀",
    "<|im_start|>",
    "<|im_end|>",
    " " * 40,
    "=" * 30,
    "ﬁ",
    "e\u0301",
    "\u1faf",
    "\u0000",
]
TEXTS = st.lists(st.sampled_from(PIECES), max_size=60).map("".join)


def wrapped(hf) -> Tokenizer:
    tokenizer = Tokenizer.__new__(Tokenizer)
    tokenizer._tok = hf
    return tokenizer


@pytest.fixture(scope="module")
def smollm2(smollm2_hf_tokenizer) -> Tokenizer:
    return wrapped(smollm2_hf_tokenizer)


@pytest.fixture(scope="module")
def sentencepiece() -> Tokenizer:
    return wrapped(llama_style_tokenizer())


@given(text=TEXTS, repeat=st.integers(1, 40))
def test_issue28_4_the_length_bound_never_exceeds_the_encoding_on_smollm2(
    smollm2, text: str, repeat: int
) -> None:
    whole = text * repeat
    assert smollm2.min_tokens(whole) <= len(smollm2.encode(whole))


@given(text=TEXTS, repeat=st.integers(1, 40))
def test_issue28_4_the_length_bound_never_exceeds_the_encoding_on_sentencepiece(
    sentencepiece, text: str, repeat: int
) -> None:
    whole = text * repeat
    assert sentencepiece.min_tokens(whole) <= len(sentencepiece.encode(whole))


def test_issue28_4_the_bound_refuses_what_cannot_fit_and_nothing_it_cannot_prove(smollm2) -> None:
    per_token = smollm2.max_token_chars
    assert smollm2.min_tokens("x" * (per_token * 1000)) == 1000  # what it can prove, exactly
    # normalizers that may delete characters allow no bound; composition at most four to one
    assert _shrink({"type": "StripAccents"}) is None
    assert _shrink({"type": "Replace", "pattern": {"String": "ab"}, "content": ""}) is None
    assert _shrink({"type": "Sequence", "normalizers": [{"type": "NFKC"}]}) == 4
    assert _shrink(None) == 1


@pytest.mark.parametrize("text", ["héllo 😀 日本 x", "<|im_start|>user\n", "a\u0301 ﬁ\n\n\t"])
def test_each_token_s_bytes_join_into_the_text(smollm2, sentencepiece, text: str) -> None:
    for tokenizer in (smollm2, sentencepiece):
        ids = tokenizer.encode(text)
        raw = b"".join(tokenizer.token_bytes(i) for i in ids).decode()
        # special tokens stand for their own text; SentencePiece's first piece carries the
        # space it prepends to the text
        whole = tokenizer._tok.decode(ids, skip_special_tokens=False)
        assert raw.removeprefix(" ") == whole.removeprefix(" ") == text, tokenizer
