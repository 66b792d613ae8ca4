"""Completion logprobs when a character is split across tokens (issue 28, finding 10): each
token's text is what it added to the answer (the first half of a split character adds "", the
second the whole character), so the tokens join into the text and ``text_offset`` indexes it.
Before, each token's text was its own decode (a replacement character for each half), and the
offsets ran past the text. On the stand-in tokenizer of ``test_text_stream``."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from raykv.core.step import TokenLogprobs
from raykv.serve.answers import AnswerShape
from raykv.serve.text_stream import TextStream
from raykv.serve.token_text import TokenText
from tests.serve.test_text_stream import EURO, decode, ids


class StandIn(TokenText):
    """Both replicas' token text (``TokenText``) on the stand-in tokenizer's decoder."""

    def decode(self, token_ids):
        return decode(list(token_ids))


def test_issue28_10_split_characters_keep_tokens_and_offsets_on_the_text() -> None:
    texts = StandIn(None, "r")
    text = TextStream(texts.decode)
    pushes = [ids("a "), [1000], [1001], ids(" b"), [1000, 1001], ids("!")]
    updates = []
    for tokens in pushes:
        logprobs = [TokenLogprobs(-0.5, {t: -0.5}) for t in tokens]
        updates.append(texts.update(text, tokens, logprobs))
    answer = "".join(u.text for u in updates) + text.finish()
    assert answer == f"a {EURO} b{EURO}!"
    infos = [i for u in updates for i in u.logprobs]
    shape = AnswerShape("cmpl-x", "m", chat=False, logprobs=True)
    out = shape._logprob_shape(infos)
    assert "".join(out["tokens"]) == answer
    assert "\ufffd" not in "".join(out["tokens"])
    for token, offset in zip(out["tokens"], out["text_offset"], strict=True):
        assert answer[offset : offset + len(token)] == token
