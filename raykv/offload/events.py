"""KV events announcing what the CPU tier holds, with gap-detectable sequence numbers."""

from __future__ import annotations

from dataclasses import dataclass

MEDIUM_CPU = "CPU"


@dataclass(slots=True, frozen=True)
class BlockStored:
    """The keys became readable in ``medium`` (a store completed)."""

    seq: int
    keys: tuple[int, ...]
    medium: str = MEDIUM_CPU


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """The keys are gone from ``medium`` (eviction or reset)."""

    seq: int
    keys: tuple[int, ...]
    medium: str = MEDIUM_CPU


KVEvent = BlockStored | BlockRemoved


class EventLog:
    """Buffers events until taken. Sequence numbers increase by one per event and never restart,
    so a consumer that sees a jump knows it missed events and must resynchronise."""

    __slots__ = ("_buffer", "_next_seq", "enabled")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._next_seq = 0
        self._buffer: list[KVEvent] = []

    def stored(self, keys: list[int]) -> None:
        if self.enabled and keys:
            self._buffer.append(BlockStored(self._next_seq, tuple(keys)))
            self._next_seq += 1

    def removed(self, keys: list[int]) -> None:
        if self.enabled and keys:
            self._buffer.append(BlockRemoved(self._next_seq, tuple(keys)))
            self._next_seq += 1

    def take(self) -> list[KVEvent]:
        out, self._buffer = self._buffer, []
        return out

    @property
    def next_seq(self) -> int:
        return self._next_seq
