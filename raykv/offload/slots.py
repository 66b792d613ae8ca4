"""Slot allocator for the fixed set of CPU-tier slots."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable


class SlotAllocator:
    """Hands out slot ids 0..capacity-1.

    Never-used slots come first, from a bump pointer in increasing order; after that, freed slots
    are reused last-freed first. Filling the pool front to back, then reusing the most recently
    freed slots, keeps the touched part of a large, lazily committed CPU pool small.

    A slot given back *held* (``hold``) is free again only after a while: a read into it that
    failed may still be landing (``clock``: seconds, monotonic).
    """

    __slots__ = ("_capacity", "_clock", "_free", "_held", "_holds", "_next", "_num_held")

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity <= 0:
            raise ValueError(f"slot capacity must be positive, got {capacity}")
        self._capacity = capacity
        self._next = 0
        self._free: list[int] = []
        self._clock = clock
        self._held: list[tuple[float, int, list[int]]] = []  # heap: (free from, order, slots)
        self._holds = 0
        self._num_held = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        if self._held:
            self._thaw()
        return len(self._free) + self._capacity - self._next

    @property
    def num_held(self) -> int:
        """Slots given back held, not yet free."""
        if self._held:
            self._thaw()
        return self._num_held

    def allocate(self, n: int) -> list[int]:
        """Return n distinct free slots; raises if fewer are free (callers check first)."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} slots with only {self.num_free} free")
        fresh = min(n, self._capacity - self._next)
        out = list(range(self._next, self._next + fresh))
        self._next += fresh
        reuse = n - fresh
        if reuse:
            free = self._free
            tail = free[-reuse:]
            del free[-reuse:]
            tail.reverse()  # last freed first
            out.extend(tail)
        return out

    def release(self, slots: list[int]) -> None:
        """Give slots back. The caller guarantees each was allocated and is released once."""
        self._free.extend(slots)

    def hold(self, slots: list[int], seconds: float) -> None:
        """Give slots back, free only ``seconds`` from now."""
        if slots:
            self._holds += 1
            heapq.heappush(self._held, (self._clock() + seconds, self._holds, list(slots)))
            self._num_held += len(slots)

    def _thaw(self) -> None:
        now, held = self._clock(), self._held
        while held and held[0][0] <= now:
            _, _, slots = heapq.heappop(held)
            self._num_held -= len(slots)
            self._free[:0] = slots  # reused after the slots freed since

    def free_slots(self) -> set[int]:
        """Every free slot id (for invariant checks; O(capacity))."""
        return set(self._free) | set(range(self._next, self._capacity))

    def held_slots(self) -> set[int]:
        """Every held slot id (for invariant checks)."""
        return {slot for _, _, slots in self._held for slot in slots}

    def reset(self) -> None:
        """Every slot free, except those held: a reset does not stop a read landing."""
        held = self.held_slots()
        self._free.clear()
        if not held:
            self._next = 0
            return
        self._next = self._capacity
        self._free.extend(s for s in range(self._capacity - 1, -1, -1) if s not in held)
