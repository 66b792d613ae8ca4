"""Least-recently-used eviction, prefix-aware."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from itertools import islice

from raykv.offload.policies.base import CachePolicy


class LRUPolicy(CachePolicy):
    """LRU over the evictable keys only.

    Keys are refreshed in reverse prefix order, so a request's first chunk ends up most recent and
    its tail is given up first: a tail is worthless once its head is gone, never the other way
    round. Busy keys (being written or read) are simply absent from the order and re-enter at the
    most recent end when they become idle.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._idle: OrderedDict[int, None] = OrderedDict()

    def insert(self, keys: list[int]) -> None:
        pass

    def ready(self, keys: list[int]) -> None:
        self._idle.update(dict.fromkeys(reversed(keys)))

    def pin(self, keys: list[int]) -> None:
        idle = self._idle
        for key in keys:
            del idle[key]

    def unpin(self, keys: list[int]) -> None:
        idle = self._idle
        for key in reversed(keys):
            idle[key] = None

    def remove(self, keys: list[int]) -> None:
        idle = self._idle
        for key in keys:
            idle.pop(key, None)

    def touch(self, keys: Sequence[int]) -> None:
        move = self._idle.move_to_end
        for key in reversed(keys):
            try:  # noqa: SIM105 - suppress() costs a context manager per key on a hot path
                move(key)
            except KeyError:  # absent or busy: busy keys re-enter as most recent when idle
                pass

    def evict(self, n: int, protected: Collection[int]) -> list[int] | None:
        if n <= 0:
            return []
        idle = self._idle
        if n > len(idle):
            return None
        victims = list(islice(idle, n))
        if protected and not _disjoint(protected, victims):
            victims = list(islice((k for k in idle if k not in protected), n))
            if len(victims) < n:
                return None
            for key in victims:
                del idle[key]
            return victims
        pop = idle.popitem
        for _ in range(n):
            pop(last=False)
        return victims

    def clear(self) -> None:
        self._idle.clear()


def _disjoint(protected: Collection[int], keys: list[int]) -> bool:
    if isinstance(protected, (set, frozenset)):
        return protected.isdisjoint(keys)
    return not any(k in protected for k in keys)
