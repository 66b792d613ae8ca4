"""Token ids to text as they come: incremental detokenization and stop strings.

A token may end in the middle of a UTF-8 character and a stop string may span tokens, so text is
released only once it can no longer change: never a trailing replacement character, and never
the last characters that could still be the start of a stop string.

Both are done in time flat in the stream's length. Decoding looks only at a short window: the
tokens of the last piece of text that came out whole (the context, so that a decoder that reads
a token differently at the start of a text, as SentencePiece drops a word's leading space,
decodes the new tokens as it would inside the whole text) and the tokens since (pending). What
the window decodes to beyond the context's own text is the new text. Stop strings are matched
by one Knuth-Morris-Pratt state each, fed every new character once.

The text is the same as decoding all the tokens at once for decoders whose text of a token list
begins with their text of its first part, which byte-level BPE and SentencePiece ones are on
valid UTF-8. Two kinds of broken bytes are where it may differ: more than
``_MAX_PENDING_TOKENS`` tokens in a row that never complete a character, then completed; and
the byte-fallback decoder's rule that turns a whole run of byte tokens into replacement
characters when any of them is invalid, bytes already released included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

_INCOMPLETE = "\ufffd"  # what a decoder gives for a partial UTF-8 sequence
# A character left incomplete spans at most 3 more bytes, so at most a few tokens (a few more if
# skipped special tokens fall inside it). Pending tokens that still end incomplete after this
# many are broken bytes that no later token completes: they are taken as the replacement
# characters they decode to, which keeps the window, and so the cost of a token, bounded.
_MAX_PENDING_TOKENS = 16


@dataclass(slots=True)
class _StopMatcher:
    """One stop string and how many of its first characters the text now ends with (the state
    of a Knuth-Morris-Pratt automaton)."""

    stop: str
    # fallback[n]: the longest proper prefix of stop[:n] that is also its suffix, the state to
    # go on from when the character after stop[:n] does not match
    fallback: list[int]
    matched: int = 0

    @classmethod
    def of(cls, stop: str) -> _StopMatcher:
        fallback = [0] * (len(stop) + 1)
        border = 0
        for n in range(1, len(stop)):
            while border and stop[n] != stop[border]:
                border = fallback[border]
            if stop[n] == stop[border]:
                border += 1
            fallback[n + 1] = border
        return cls(stop, fallback)

    def find_in(self, text: str) -> int | None:
        """Feed ``text``; the index in it where a whole match ends (its last character), or None.
        Each character costs O(1) amortized: a fallback undoes at most what a match added."""
        stop, fallback, matched = self.stop, self.fallback, self.matched
        for index, char in enumerate(text):
            while matched and stop[matched] != char:
                matched = fallback[matched]
            if stop[matched] == char:
                matched += 1
                if matched == len(stop):
                    self.matched = matched
                    return index
        self.matched = matched
        return None


@dataclass(slots=True)
class TextStream:
    """The text of one request's output so far. ``push`` takes the new token ids and returns
    the text now safe to send; ``stopped`` turns true when a stop string matched (the text
    ends before the earliest match, and the caller stops the request). ``finish`` releases
    what was held. ``text`` is the text decoded so far (without a character still incomplete
    until ``finish``), cut before the stop string once stopped; ``token_texts`` and
    ``token_offsets`` say which part of it each token added. Empty stop strings are ignored
    (the API refuses them)."""

    decode: Callable[[Sequence[int]], str]
    stops: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list, init=False)
    sent: int = field(default=0, init=False)  # characters of the text already released
    stopped: bool = field(default=False, init=False)
    _matchers: list[_StopMatcher] = field(default_factory=list, init=False, repr=False)
    _context: list[int] = field(default_factory=list, init=False, repr=False)
    _context_chars: int = field(default=0, init=False, repr=False)  # len(decode(_context))
    # whether the context holds a token that decodes to something, so that a new token is never
    # the first of the window (false until the stream's first text)
    _context_leads: bool = field(default=False, init=False, repr=False)
    _pending: list[int] = field(default_factory=list, init=False, repr=False)
    _pending_taken: int = field(default=0, init=False, repr=False)  # characters of it taken
    _token_texts: list[str] = field(default_factory=list, init=False, repr=False)
    _token_offsets: list[int] = field(default_factory=list, init=False, repr=False)
    _length: int = field(default=0, init=False, repr=False)  # characters decoded, before a cut
    _held: str = field(default="", init=False, repr=False)  # decoded but not yet released
    _cut: int | None = field(default=None, init=False, repr=False)  # where a stop cut the text
    _joined: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        self._matchers = [_StopMatcher.of(stop) for stop in self.stops if stop]

    def push(self, token_ids: Sequence[int]) -> str:
        """Take the next token ids; the text now safe to send (maybe empty)."""
        if self.stopped or not token_ids:
            return ""
        start = self._length
        new = "".join([self._take(token) for token in token_ids])
        return self._settle(new, start, final=False)

    def finish(self) -> str:
        """The rest of the text, at the end of the request: what was held back, and a character
        left incomplete as the replacement characters it decodes to."""
        if self.stopped:
            return ""
        start = self._length
        return self._settle(self._flush(), start, final=True)

    @property
    def text(self) -> str:
        """The text decoded so far (see the class); built again when it grew, so O(length):
        not a thing to read once a token."""
        if len(self._joined) != self._length:
            self._joined = "".join(self._token_texts)
        return self._joined if self._cut is None else self._joined[: self._cut]

    def token_texts(self, start: int = 0, end: int | None = None) -> list[str]:
        """The text each of ``tokens[start:end]`` added to the decoded text: a character split
        across tokens belongs whole to the token that completed it (the others add ""), a
        skipped special token adds "". Joined over all tokens they are ``text`` before any stop
        cut it; only the last token's may still grow, at ``finish``."""
        return self._token_texts[start:end]

    def token_offsets(self, start: int = 0, end: int | None = None) -> list[int]:
        """Where in the decoded text (before any stop cut) the text of each of
        ``tokens[start:end]`` begins."""
        return self._token_offsets[start:end]

    # ---- decoding ---------------------------------------------------------------------------

    def _take(self, token: int) -> str:
        """Decode one more token; the characters it made whole."""
        self.tokens.append(token)
        self._pending.append(token)
        tail = self.decode(self._context + self._pending)[self._context_chars :]
        whole = len(tail.rstrip(_INCOMPLETE))
        if whole < len(tail) and len(self._pending) < _MAX_PENDING_TOKENS:
            # a character is still incomplete: what comes before it is final all the same
            piece = tail[self._pending_taken : whole]
            self._pending_taken = max(self._pending_taken, whole)
        elif not tail and not self._context_leads:
            # Nothing came out yet, and maybe not only because these are skipped special tokens:
            # a decoder may drop the leading space of a text's first token (SentencePiece), text
            # that whole decoding gives back once a token follows. So they stay pending.
            piece = ""
            if len(self._pending) >= _MAX_PENDING_TOKENS:
                self._keep_silent_start()
        else:
            piece = self._advance(tail)
        self._token_offsets.append(self._length)
        self._token_texts.append(piece)
        self._length += len(piece)
        return piece

    def _advance(self, tail: str) -> str:
        """The pending tokens' text is final: they become the context."""
        piece = tail[self._pending_taken :]
        # tokens that decoded to nothing (skipped special tokens) are left out of the window:
        # kept as context they would give the next token nothing to lean on, kept pending a
        # run of them would make the window grow
        if tail:
            self._context = self._pending
            self._context_chars = len(self.decode(self._context))
            self._context_leads = True
        self._pending = []
        self._pending_taken = 0
        return piece

    def _keep_silent_start(self) -> None:
        """Bound a run of tokens that decode to nothing at the stream's start. Only the first
        token that is not skipped can lose its text to the window start (any after it would
        decode to something), so either the run holds one (decoded twice over, the second copy
        shows) and becomes the context, or it is only skipped tokens and is left out."""
        if self.decode(self._pending + self._pending):
            self._context = self._pending
            self._context_chars = 0
            self._context_leads = True
        self._pending = []

    def _flush(self) -> str:
        """The rest of the pending tokens' text, given to the last token."""
        if not self._pending:
            return ""
        tail = self.decode(self._context + self._pending)[self._context_chars :]
        piece = self._advance(tail)
        self._token_texts[-1] += piece
        self._length += len(piece)
        return piece

    # ---- stop strings and release -----------------------------------------------------------

    def _settle(self, new: str, start: int, final: bool) -> str:
        """Match the stop strings over ``new`` (the text from ``start``) and release what is
        safe: up to the earliest match, else all but a possible start of a stop string (all,
        when ``final``)."""
        matches = []
        for matcher in self._matchers:
            index = matcher.find_in(new)
            if index is not None:
                matches.append(start + index + 1 - len(matcher.stop))
        if matches:
            self.stopped = True
            self._cut = end = min(matches)
        elif final:
            end = self._length
        else:
            end = self._length - max((m.matched for m in self._matchers), default=0)
        unsent = self._held + new  # the text from ``sent`` on
        released = unsent[: max(0, end - self.sent)]
        self._held = "" if self.stopped else unsent[len(released) :]
        self.sent += len(released)
        return released
