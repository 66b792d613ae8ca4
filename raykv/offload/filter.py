"""Frequency filter: store only chunks that lookups have asked for often enough."""

from __future__ import annotations

from collections import OrderedDict


class FrequencyFilter:
    """Counts lookups per key in a bounded tracker (least recently counted keys are forgotten
    first) and passes keys whose count has reached ``threshold``.

    This is the classic guard against one-shot chunks (for example decode tails) filling the tier.
    """

    __slots__ = ("_counts", "max_size", "threshold")

    def __init__(self, threshold: int, max_size: int) -> None:
        if threshold < 2:
            raise ValueError(f"a frequency filter needs threshold >= 2, got {threshold}")
        if max_size <= 0:
            raise ValueError(f"max_size must be positive, got {max_size}")
        self.threshold = threshold
        self.max_size = max_size
        self._counts: OrderedDict[int, int] = OrderedDict()

    def bump(self, key: int) -> None:
        counts = self._counts
        counts[key] = counts.pop(key, 0) + 1
        if len(counts) > self.max_size:
            counts.popitem(last=False)

    def count(self, key: int) -> int:
        return self._counts.get(key, 0)

    def passes(self, keys: list[int]) -> list[int]:
        counts, threshold = self._counts, self.threshold
        return [k for k in keys if counts.get(k, 0) >= threshold]

    def clear(self) -> None:
        self._counts.clear()

    def __len__(self) -> int:
        return len(self._counts)
