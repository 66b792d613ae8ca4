"""``recall``: raykv's own policy, ARC with a long memory of the keys it has stored."""

from __future__ import annotations

from collections.abc import Collection

from raykv.offload.policies.arc import ARCPolicy
from raykv.offload.policies.history import SeenFilter

DEFAULT_HISTORY_FACTOR = 128
HISTORY_BITS_PER_KEY = 12


class RecallPolicy(ARCPolicy):
    """ARC whose notion of "used before" reaches far beyond its ghost lists.

    What request traces reward: most stored chunks are never asked for again, and the ones that
    are come back after long gaps, typically far longer than the tier holds anything (on the
    Mooncake trace the median gap between two requests of one document is ~3.5M tokens). ARC
    separates once-used chunks (T1) from reused ones (T2) and so resists one-shot chunks, but it
    only remembers as many evicted keys as it has slots: a chunk returning after a long gap looks
    brand new, lands in T1 again, and the next wave of one-shot chunks pushes it out before its
    next return.

    ``recall`` adds a compact memory (``SeenFilter``: two generations of a Bloom filter, 12 bits
    per key each) of the last ``history_factor`` x capacity keys it stored. A chunk stored again
    while that memory still holds it has proven that it comes back, so it enters T2 directly;
    one-shot chunks still only ever reach T1, and ARC's adaptive T1/T2 split is kept as is. Memory
    cost: about 2 x history_factor x 12 / 16 bytes per slot (~190 bytes at the default), small
    next to the chunk a slot holds.

    Chain structure is respected as in the other built-in policies: keys are entered and refreshed
    in reverse prefix order, so within a list a prefix's tail is given up before its head (a chunk
    is useless without the chunks before it).
    """

    name = "recall"

    def __init__(self, capacity: int, history_factor: int = DEFAULT_HISTORY_FACTOR) -> None:
        super().__init__(capacity)
        self.history = SeenFilter(max(2, history_factor * capacity), HISTORY_BITS_PER_KEY)

    def _returning(self, keys: list[int]) -> Collection[int]:
        return self.history.check_and_add(keys)

    def clear(self) -> None:
        super().clear()
        self.history.clear()
