"""Slot allocator for the fixed set of CPU-tier slots."""

from __future__ import annotations


class SlotAllocator:
    """Hands out slot ids 0..capacity-1.

    Never-used slots come first, from a bump pointer in increasing order; after that, freed slots
    are reused last-freed first. Filling the pool front to back, then reusing the most recently
    freed slots, keeps the touched part of a large, lazily committed CPU pool small.
    """

    __slots__ = ("_capacity", "_free", "_next")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"slot capacity must be positive, got {capacity}")
        self._capacity = capacity
        self._next = 0
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return len(self._free) + self._capacity - self._next

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

    def free_slots(self) -> set[int]:
        """Every free slot id (for invariant checks; O(capacity))."""
        return set(self._free) | set(range(self._next, self._capacity))

    def reset(self) -> None:
        self._next = 0
        self._free.clear()
