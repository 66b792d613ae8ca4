"""The GPU block pool with prefix caching, shared by every KV group.

Block 0 is the null block: never allocated, it stands in a block table for positions that hold
no KV (sliding-window positions that left the window, stale entries). Every other block is either
in use (reference count > 0) or free. Free blocks wait in a queue, least recently freed first;
a free block may still hold a cached prefix (its key stays in the cache map) and can be revived by
a prefix hit until allocation hands it out, at which point its cached key is dropped.

With an event log, publishing a key is a ``BlockStored`` and dropping one a ``BlockRemoved``
(medium ``GPU``): what a router needs to know which prefixes this engine's GPU holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from raykv.core.kv_events import MEDIUM_GPU, EventLog

NULL_BLOCK = 0


class BlockPool:
    """Fixed pool of ``num_blocks`` GPU blocks (including the null block)."""

    def __init__(self, num_blocks: int, events: EventLog | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_gpu_blocks must be at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._key: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # key -> block holding it
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.events = events

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Blocks a single request can ever hold (all but the null block)."""
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (least recently freed first), dropping any prefix they cached."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} GPU blocks with {len(self._free)} free")
        out = []
        dropped = []
        pop = self._free.popitem
        for _ in range(n):
            block, _ = pop(last=False)
            key = self._key[block]
            if key is not None:
                del self._cached[key]
                self._key[block] = None
                dropped.append(key)
            self._ref[block] = 1
            out.append(block)
        if dropped and self.events is not None:
            self.events.removed(dropped, MEDIUM_GPU)
        return out

    def lookup(self, key: int) -> int | None:
        """The block caching ``key``, if any (in use or free)."""
        return self._cached.get(key)

    def acquire(self, block: int) -> None:
        """Take one more reference to a cached block, reviving it if it was free."""
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching zero join the free queue in the
        order given (so callers pass tails first to have them reused first)."""
        ref, free = self._ref, self._free
        for block in blocks:
            if block == NULL_BLOCK:
                continue
            if ref[block] <= 0:
                raise RuntimeError(f"GPU block {block} freed more often than allocated")
            ref[block] -= 1
            if ref[block] == 0:
                free[block] = None

    def cache(self, block: int, key: int) -> None:
        """Publish ``block`` (full, computed) as holding the prefix ``key``. A key already cached
        by another block keeps that block; this one is simply not published."""
        if self._key[block] is not None or key in self._cached:
            return
        self._key[block] = key
        self._cached[key] = block
        if self.events is not None:
            self.events.stored((key,), MEDIUM_GPU)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def cached_key(self, block: int) -> int | None:
        return self._key[block]

    def cached_keys(self) -> list[int]:
        """Every key the prefix cache holds now (a consumer of the events resyncs from it)."""
        return list(self._cached)

    def reset_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents, but hit nobody)."""
        if self.events is not None:
            self.events.removed(self._cached, MEDIUM_GPU)
        self._cached.clear()
        self._key = [None] * self.num_blocks

    def check_invariants(self) -> None:
        assert self._ref[NULL_BLOCK] == 0 and NULL_BLOCK not in self._free
        for block in range(1, self.num_blocks):
            assert (self._ref[block] == 0) == (block in self._free), f"block {block} books"
            assert self._ref[block] >= 0
        for key, block in self._cached.items():
            assert self._key[block] == key
