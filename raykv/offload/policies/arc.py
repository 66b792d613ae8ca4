"""Adaptive Replacement Cache (Megiddo & Modha), adapted to a directory with busy keys."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from itertools import islice

from raykv.offload.policies.base import CachePolicy


class ARCPolicy(CachePolicy):
    """ARC: T1 holds keys used once, T2 keys used again; B1/B2 remember keys recently evicted
    from each. A re-store of a key remembered in B1 says T1 was too small (the target for T1
    grows); one remembered in B2 says T2 was too small (it shrinks). Such keys go straight to T2.

    Differences from the textbook, forced by the directory:

    - Keys being written or read are resident but not evictable; eviction skips them.
    - A key still being written is not re-used by a touch: preparing a store is not an access, so
      such a key stays in T1 (refreshed) rather than being promoted.
    - Ghost hits are counted when a key is stored again (the miss), not when touched, so a request
      that touches its whole prefix does not adapt the target twice.
    - Touch walks keys in reverse prefix order, leaving a request's first chunk most recent.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self._busy: set[int] = set()
        self._writing: set[int] = set()
        self.target = 0.0

    def insert(self, keys: list[int]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        returning = self._returning(keys)
        for key in reversed(keys):
            if key in b1:
                self.target = min(self.target + max(1.0, len(b2) / len(b1)), self.capacity)
                del b1[key]
                t2[key] = None
            elif key in b2:
                self.target = max(self.target - max(1.0, len(b1) / len(b2)), 0.0)
                del b2[key]
                t2[key] = None
            elif key in returning:
                t2[key] = None
            else:
                t1[key] = None
        self._busy.update(keys)
        self._writing.update(keys)

    def _returning(self, keys: list[int]) -> Collection[int]:
        """Keys that count as used before (so enter T2) even when absent from the ghost lists."""
        return ()

    def ready(self, keys: list[int]) -> None:
        self._busy.difference_update(keys)
        self._writing.difference_update(keys)

    def pin(self, keys: list[int]) -> None:
        self._busy.update(keys)

    def unpin(self, keys: list[int]) -> None:
        self._busy.difference_update(keys)

    def remove(self, keys: list[int]) -> None:
        for key in keys:
            if self._t1.pop(key, 0) == 0:
                self._t2.pop(key, None)
        self._busy.difference_update(keys)
        self._writing.difference_update(keys)

    def touch(self, keys: Sequence[int]) -> None:
        t1, t2, writing = self._t1, self._t2, self._writing
        for key in reversed(keys):
            if key in t1:
                if key in writing:
                    t1.move_to_end(key)
                else:
                    del t1[key]
                    t2[key] = None
            elif key in t2:
                t2.move_to_end(key)

    def _candidates(self, lst: OrderedDict[int, None], protected: Collection[int]) -> Iterator[int]:
        busy = self._busy
        return (k for k in lst if k not in busy and k not in protected)

    def evict(self, n: int, protected: Collection[int]) -> list[int] | None:
        if n <= 0:
            return []
        # ARC takes from T1 while T1, less what was already taken from it, is at least the target
        # size; otherwise from T2; and from the other list when the preferred one runs dry.
        threshold = max(self.target, 1.0)
        len_t1 = len(self._t1)
        prefer_t1 = 0 if len_t1 < threshold else min(n, int(len_t1 - threshold) + 1)
        it1 = self._candidates(self._t1, protected)
        it2 = self._candidates(self._t2, protected)
        from1 = list(islice(it1, prefer_t1))
        from2 = list(islice(it2, n - len(from1)))
        if len(from1) + len(from2) < n:
            from1.extend(islice(it1, n - len(from1) - len(from2)))
            if len(from1) + len(from2) < n:
                return None
        self._commit(from1, self._t1, self._b1)
        self._commit(from2, self._t2, self._b2)
        return from1 + from2

    def _commit(
        self, victims: list[int], live: OrderedDict[int, None], ghost: OrderedDict[int, None]
    ) -> None:
        for key in victims:
            del live[key]
            ghost[key] = None
        while len(ghost) > self.capacity:
            ghost.popitem(last=False)

    def clear(self) -> None:
        for d in (self._t1, self._t2, self._b1, self._b2):
            d.clear()
        self._busy.clear()
        self._writing.clear()
        self.target = 0.0

    def stats(self) -> dict[str, float]:
        return {
            "target_t1": self.target,
            "t1": len(self._t1),
            "t2": len(self._t2),
            "b1": len(self._b1),
            "b2": len(self._b2),
        }
