"""Streaming detokenization: does a token's cost grow with the length of its stream?

A long token sequence (a multilingual passage with emoji, CJK, scripts of many kinds, code and
whitespace, encoded by the model's tokenizer and repeated) goes through the server's
``TextStream`` one token per push, as a replica streams a request, with stop strings that
never match (one of them as long as the API allows), so that stop matching and hold-back run
too. The cost per token is measured over the first window of tokens and over the last one:
their ratio should be about 1. Beside it, in the same run, the old way (decoding every token of
the stream on each push) on a shorter prefix: its cost per token grows with the position.

Times are wall-clock and so depend on the machine; the ids handed to the decoder per token
(``decoded_ids_per_token``) are exact and say the same thing without a clock. The incremental
text is checked against decoding all the tokens at once (``same_text``).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from raykv.serve.protocol import MAX_STOP_CHARS
from raykv.serve.text_stream import TextStream

# written for this bench: words and scripts whose characters span byte-level tokens, and the
# whitespace and punctuation that tokenizers split in their own ways
SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog; naïve café owners say «déjà vu» — twice.\n"
    "机器学习让计算机从数据中学习规律\uff0c而不是依靠明确的规则。東京の天気は晴れです。"
    "서울에서 부산까지 기차로 두 시간 반이 걸린다.\n"
    "Съешь же ещё этих мягких французских булок, да выпей чаю. Γειά \u03c3\u03bf\u03c5 Κόσμε!\n"
    "مرحبا بكم في عالم البرمجة. שלום עולם. नमस्ते दुनिया। สวัสดีชาวโลก\n"
    "Emoji: 😀🎉👍🏽 👩\u200d💻 🇺🇳 ✅ — math: ∑ xᵢ² ≤ ∞, π ≈ 3.14159\n"
    "def mean(values: list[float]) -> float:\n"
    "    return sum(values) / len(values)  # never empty here\n\n"
    "\t  tabs, \u00a0non-breaking spaces,   and runs of spaces.\n"
)


class DetokenizeTokenizer(Protocol):
    """What the bench needs of a tokenizer (raykv's ``Tokenizer`` has it)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


def default_stops() -> list[str]:
    """Stop strings absent from the sample: a short one, and one of the longest allowed."""
    return ["\n\nUser:", "\u2603" * (MAX_STOP_CHARS - 1) + "!"]


@dataclass(slots=True)
class _CountingDecode:
    """A decoder that counts the token ids it is handed."""

    decode: Callable[[Sequence[int]], str]
    ids: int = 0

    def __call__(self, token_ids: Sequence[int]) -> str:
        self.ids += len(token_ids)
        return self.decode(token_ids)


@dataclass(slots=True)
class _WholeDecodeStream:
    """The old way: decode every token so far on each push, release what is new (without a
    trailing half character)."""

    decode: Callable[[Sequence[int]], str]
    tokens: list[int]
    sent: int = 0

    def push(self, token_ids: Sequence[int]) -> str:
        self.tokens.extend(token_ids)
        text = self.decode(self.tokens)
        end = len(text.rstrip("\ufffd"))
        out = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out


def long_token_ids(tokenizer: DetokenizeTokenizer, num_tokens: int) -> list[int]:
    """``num_tokens`` ids: the sample's tokens, repeated."""
    unit = tokenizer.encode(SAMPLE_TEXT)
    return (unit * (num_tokens // len(unit) + 1))[:num_tokens]


def _stream_one_token_a_push(
    push: Callable[[Sequence[int]], str],
    counter: _CountingDecode,
    token_ids: list[int],
    window: int,
) -> tuple[dict[str, float], str]:
    """Push ``token_ids`` one at a time; the cost per token in the first and last ``window``
    tokens (wall clock and ids decoded), and the text released."""
    last_start = len(token_ids) - window
    spent = {"first": 0, "last": 0}
    ids_decoded = {"first": 0, "last": 0}
    out: list[str] = []
    gc.collect()
    begin = time.perf_counter()
    for index, token in enumerate(token_ids):
        which = "first" if index < window else "last" if index >= last_start else None
        ids_before = counter.ids
        start = time.perf_counter_ns()
        out.append(push([token]))
        if which is not None:
            spent[which] += time.perf_counter_ns() - start
            ids_decoded[which] += counter.ids - ids_before
    total = time.perf_counter() - begin
    first_us = spent["first"] / window / 1e3
    last_us = spent["last"] / window / 1e3
    report = {
        "num_tokens": len(token_ids),
        "first_window_us_per_token": first_us,
        "last_window_us_per_token": last_us,
        "ratio": last_us / first_us if first_us else float("nan"),
        "first_window_decoded_ids_per_token": ids_decoded["first"] / window,
        "last_window_decoded_ids_per_token": ids_decoded["last"] / window,
        "total_s": total,
    }
    return report, "".join(out)


def run_detokenize_bench(
    tokenizer: DetokenizeTokenizer,
    num_tokens: int = 50_000,
    window: int = 1_000,
    whole_decode_tokens: int = 4_000,
    stops: list[str] | None = None,
) -> dict[str, Any]:
    """Stream ``num_tokens`` tokens through ``TextStream`` one a push and the first
    ``whole_decode_tokens`` of them the old way; each one's cost per token in its first and
    last ``window`` tokens. ``same_text``: the stream released exactly what decoding all the
    tokens at once gives (and no stop string matched)."""
    if num_tokens < 2 * window or whole_decode_tokens < 2 * window:
        raise ValueError(f"both streams need at least two windows of {window} tokens")
    if whole_decode_tokens > num_tokens:
        raise ValueError("the old way runs on a prefix of the stream: at most num_tokens")
    token_ids = long_token_ids(tokenizer, num_tokens)
    stops = default_stops() if stops is None else stops

    counter = _CountingDecode(tokenizer.decode)
    stream = TextStream(counter, list(stops))
    incremental, released = _stream_one_token_a_push(stream.push, counter, token_ids, window)
    released += stream.finish()

    old_counter = _CountingDecode(tokenizer.decode)
    old = _WholeDecodeStream(old_counter, [])
    whole_decode, _ = _stream_one_token_a_push(
        old.push, old_counter, token_ids[:whole_decode_tokens], window
    )
    return {
        "num_tokens": num_tokens,
        "window": window,
        "characters": len(released),
        "stops": [len(stop) for stop in stops],
        "same_text": not stream.stopped and released == tokenizer.decode(token_ids),
        "incremental": incremental,
        "whole_decode": whole_decode,
    }


def report_lines(result: dict[str, Any]) -> list[str]:
    """``run_detokenize_bench``'s result as the lines ``raykv bench detokenize`` prints."""
    lines = [
        f"{result['num_tokens']} tokens ({result['characters']} characters), windows of "
        f"{result['window']} tokens, stop strings of {result['stops']} characters; "
        f"same text as decoding all at once: {result['same_text']}"
    ]
    for name in ("incremental", "whole_decode"):
        part = result[name]
        lines.append(
            f"  {name:12s} {part['num_tokens']:6d} tokens: "
            f"first window {part['first_window_us_per_token']:9.2f} us/token "
            f"({part['first_window_decoded_ids_per_token']:7.1f} ids decoded/token), "
            f"last window {part['last_window_us_per_token']:9.2f} us/token "
            f"({part['last_window_decoded_ids_per_token']:7.1f} ids/token), "
            f"ratio {part['ratio']:.2f}, total {part['total_s']:.2f} s"
        )
    return lines


if __name__ == "__main__":
    from raykv.config import ModelConfig
    from raykv.model.presets import preset_path
    from raykv.model.tokenizer import Tokenizer

    # the weights cache a server uses, so that the GGUF's tokenizer is converted once
    smollm2 = Tokenizer.of(preset_path("smollm2-135m-instruct"), ModelConfig().cache_dir)
    if smollm2 is None:
        raise SystemExit("SmolLM2's GGUF has no tokenizer transformers can read")
    print("\n".join(report_lines(run_detokenize_bench(smollm2))))
