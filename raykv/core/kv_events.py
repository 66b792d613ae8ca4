"""KV events: which keys became readable or went away, on the GPU prefix cache and in the CPU
and disk tiers, in one stream per engine with gap-detectable sequence numbers.

A consumer (the serving layer's KV-aware router) mirrors what an engine holds from these alone:
``BlockStored`` adds keys to a medium, ``BlockRemoved`` takes them out, and a jump in ``seq``
means it missed some and must ask for the whole state again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_SHARED = "SHARED"


@dataclass(slots=True, frozen=True)
class BlockStored:
    """The keys became readable in ``medium`` (a GPU block published to the prefix cache; a
    store to the CPU tier completed)."""

    seq: int
    keys: tuple[int, ...]
    medium: str = MEDIUM_CPU


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """The keys are gone from ``medium`` (a cached GPU block handed out again, a CPU chunk
    evicted, a reset)."""

    seq: int
    keys: tuple[int, ...]
    medium: str = MEDIUM_CPU


KVEvent = BlockStored | BlockRemoved

# keys an event log holds untaken at most (a few MB)
MAX_BUFFERED_KEYS = 1 << 18


class EventLog:
    """Buffers events until taken. Sequence numbers increase by one per event and never restart,
    so a consumer that sees a jump knows it missed events and must resynchronise.

    Keys of the same kind and medium recorded one after the other join one event (the GPU pool
    publishes blocks one at a time): order between kinds is kept, which is all a mirror needs."""

    __slots__ = ("_buffer", "_buffered", "_next_seq", "dropped", "enabled", "max_buffered")

    def __init__(self, enabled: bool = True, max_buffered: int = MAX_BUFFERED_KEYS) -> None:
        """``max_buffered``: keys held for a consumer that does not come (an engine with
        events on and nobody taking them); past it the buffer is dropped, and a consumer that
        comes later sees the gap in ``seq`` and asks for the whole state, as after any gap."""
        self.enabled = enabled
        self.max_buffered = max_buffered
        self._next_seq = 0
        # (kind, medium, seq, keys) of each event not yet taken, the newest still growing
        self._buffer: list[tuple[type[KVEvent], str, int, list[int]]] = []
        self._buffered = 0  # keys in the buffer
        self.dropped = 0  # events dropped untaken

    def stored(self, keys: Iterable[int], medium: str = MEDIUM_CPU) -> None:
        self._add(BlockStored, keys, medium)

    def removed(self, keys: Iterable[int], medium: str = MEDIUM_CPU) -> None:
        self._add(BlockRemoved, keys, medium)

    def _add(self, kind: type[KVEvent], keys: Iterable[int], medium: str) -> None:
        if not self.enabled:
            return
        keys = list(keys)
        if not keys:
            return
        self._buffered += len(keys)
        if self._buffered > self.max_buffered:
            self.dropped += len(self._buffer)
            self._buffer = []
            self._buffered = len(keys)
        buffer = self._buffer
        if buffer and buffer[-1][0] is kind and buffer[-1][1] == medium:
            buffer[-1][3].extend(keys)
            return
        buffer.append((kind, medium, self._next_seq, keys))
        self._next_seq += 1

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first."""
        out = [kind(seq, tuple(keys), medium) for kind, medium, seq, keys in self._buffer]
        self._buffer = []
        self._buffered = 0
        return out

    @property
    def buffered(self) -> int:
        """Keys held for the next ``take`` (bounded by ``max_buffered``)."""
        return self._buffered

    @property
    def next_seq(self) -> int:
        """The sequence number the next event will carry."""
        return self._next_seq
