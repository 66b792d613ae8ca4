"""A compact, bounded memory of keys seen recently."""

from __future__ import annotations

from collections.abc import Iterable

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads sequential keys over the table
_MASK = (1 << 64) - 1


class SeenFilter:
    """Remembers roughly the last ``span`` keys added, in a few bits per key.

    Two generations of a two-hash Bloom filter: keys are added to the current generation; when it
    has taken ``span / 2`` additions it becomes the previous one and a fresh generation starts. A
    key is "seen" if either generation holds it, so memory is bounded and old keys fade out
    without per-key bookkeeping. There are no false negatives within the span; false positives (a
    new key reported as seen) stay near ``2 (1 - e^(-2/bits_per_key))^2``: about 2.8% at 16 bits
    per key, 4.7% at 12.
    """

    __slots__ = ("_bits", "_count", "_gen", "_nbits", "_old", "span")

    def __init__(self, span: int, bits_per_key: int = 16) -> None:
        if span < 2:
            raise ValueError(f"span must be at least 2 keys, got {span}")
        self.span = span
        self._gen = span // 2
        self._nbits = max(64, self._gen * bits_per_key) | 1
        self._bits = bytearray((self._nbits + 7) // 8)
        self._old = bytearray(len(self._bits))
        self._count = 0

    def __contains__(self, key: int) -> bool:
        return bool(self.check_and_add((key,), add=False))

    def add(self, keys: Iterable[int]) -> None:
        self.check_and_add(keys)

    def check_and_add(self, keys: Iterable[int], add: bool = True) -> set[int]:
        """Return the keys already seen, then (by default) remember all of them; one hash each."""
        nbits, new, old = self._nbits, self._bits, self._old
        seen = set()
        n = 0
        for key in keys:
            x = (key * _MIX) & _MASK
            i, j = x % nbits, (x >> 29) % nbits
            bi, mi, bj, mj = i >> 3, 1 << (i & 7), j >> 3, 1 << (j & 7)
            if (new[bi] & mi and new[bj] & mj) or (old[bi] & mi and old[bj] & mj):
                seen.add(key)
            if add:
                new[bi] |= mi
                new[bj] |= mj
                n += 1
        if n:
            self._count += n
            if self._count >= self._gen:
                self._old = new
                self._bits = bytearray(len(new))
                self._count = 0
        return seen

    def clear(self) -> None:
        self._bits = bytearray(len(self._bits))
        self._old = bytearray(len(self._bits))
        self._count = 0
