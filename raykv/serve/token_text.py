"""A replica's tokens as its clients read them: text through a ``TextStream`` (stop strings
held back and matched), and each token's text, bytes and top alternatives when logprobs were
asked for. One place for both replica bodies (raykv's engine and vLLM's), so answers read the
same whichever engine computed them. Plain Python: the work of a replica's text threads."""

from __future__ import annotations

from typing import Any

from raykv.core.step import TokenLogprobs
from raykv.model.tokenizer import Tokenizer
from raykv.serve.messages import EngineUpdate, TokenInfo
from raykv.serve.text_stream import TextStream


class TokenText:
    """The tokenizer of a replica's model (None: a model without one, whose text is empty)
    and the replica's Serve id, which every update names."""

    def __init__(self, tokenizer: Tokenizer | None, replica: str) -> None:
        self.tokenizer = tokenizer
        self.replica = replica

    def decode(self, token_ids: Any) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def bytes_of(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else b""

    def update(
        self, text: TextStream, tokens: list[int], logprobs: list[TokenLogprobs] | None
    ) -> EngineUpdate:
        """The update for ``tokens``: decoding, stop strings, and each token's text with its
        alternatives' when logprobs were asked for."""
        before = len(text.tokens)
        update = EngineUpdate(text.push(tokens), replica=self.replica)
        update.token_ids = text.tokens[before:]
        if logprobs is not None:
            pieces = text.token_texts(before, len(text.tokens))
            update.logprobs = [
                self.token_info(t, piece, lp)
                for t, piece, lp in zip(update.token_ids, pieces, logprobs, strict=False)
            ]
        return update

    def token_info(self, token_id: int, text: str, lp: TokenLogprobs) -> TokenInfo:
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])
        alternatives = [(t, self.decode([t]), v, self.bytes_of(t)) for t, v in top]
        return TokenInfo(token_id, text, lp.logprob, alternatives, self.bytes_of(token_id))
