"""Token ids to text as they come: incremental detokenization and stop strings.

A token may end in the middle of a UTF-8 character and a stop string may span tokens, so text is
released only once it can no longer change: never a trailing replacement character, and never
the last characters that could still be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

_INCOMPLETE = "\ufffd"  # what a decoder gives for a partial UTF-8 sequence


@dataclass(slots=True)
class TextStream:
    """The text of one request's output so far. ``push`` takes the new token ids and returns
    the text now safe to send; ``stopped`` turns true when a stop string matched (the text
    ends before it, and the caller stops the request). ``finish`` releases what was held."""

    decode: Callable[[Sequence[int]], str]
    stops: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the text already released
    stopped: bool = False
    _text: str = ""

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped or not token_ids:
            return ""
        self.tokens.extend(token_ids)
        text = self.decode(self.tokens)
        end = len(text)
        if self.stops:
            # a match may start in text released before only as far back as the longest stop
            search_from = max(0, self.sent - max(map(len, self.stops)) + 1)
            hits = [i for i in (text.find(s, search_from) for s in self.stops) if i >= 0]
            if hits:
                self.stopped = True
                self._text = text[: min(hits)]
                return self._release(len(self._text))
            end -= self._possible_stop_start(text)
        self._text = text
        while end > self.sent and text[end - 1] == _INCOMPLETE:
            end -= 1
        return self._release(end)

    def finish(self) -> str:
        """The rest of the text, at the end of the request."""
        return self._release(len(self._text))

    @property
    def text(self) -> str:
        return self._text

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        out = self._text[self.sent : end]
        self.sent = end
        return out

    def _possible_stop_start(self, text: str) -> int:
        """How many trailing characters of ``text`` begin some stop string (to hold back)."""
        held = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return held
