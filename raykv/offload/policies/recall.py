"""``recall``: raykv's own policy, ARC with a long memory of the keys it has seen."""

from __future__ import annotations

from collections.abc import Sequence

from raykv.offload.policies.arc import ARCPolicy
from raykv.offload.policies.history import SeenFilter

DEFAULT_HISTORY_FACTOR = 128


class RecallPolicy(ARCPolicy):
    """ARC whose notion of "used before" reaches far beyond its ghost lists.

    What request traces reward: most stored chunks are never asked for again, and the ones that
    are come back after long gaps, typically far longer than the tier holds anything (on the
    Mooncake trace the median gap is a few million tokens). ARC separates once-used chunks (T1)
    from reused ones (T2) and so resists one-shot chunks, but it only remembers as many evicted
    keys as it has slots: a chunk returning after a long gap looks brand new and lands in T1 again,
    where the next wave of one-shot chunks pushes it out before its next return.

    ``recall`` adds a compact memory (``SeenFilter``, a couple of bytes per key) of roughly the
    last ``history_factor`` x capacity keys stored or hit. A chunk that is stored again and is in
    that memory has proven it comes back, so it enters T2 directly. One-shot chunks still only
    ever reach T1, and ARC's adaptive split between T1 and T2 is kept as is.

    Chain structure is respected as in the other built-in policies: keys are entered and refreshed
    in reverse prefix order, so within a list a prefix's tail is given up before its head (a chunk
    is useless without the chunks before it).
    """

    name = "recall"

    def __init__(self, capacity: int, history_factor: int = DEFAULT_HISTORY_FACTOR) -> None:
        super().__init__(capacity)
        self.history = SeenFilter(max(2, history_factor * capacity), bits_per_key=12)

    def _returning(self, key: int) -> bool:
        return key in self.history

    def insert(self, keys: list[int]) -> None:
        super().insert(keys)
        self.history.add(keys)

    def touch(self, keys: Sequence[int]) -> None:
        t1, t2 = self._t1, self._t2
        self.history.add(k for k in keys if k in t1 or k in t2)
        super().touch(keys)

    def clear(self) -> None:
        super().clear()
        self.history.clear()
