"""Integer arithmetic shared by the block, chunk and window computations."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: how many units of ``b`` hold ``a``."""
    return -(-a // b)
