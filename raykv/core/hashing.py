"""Chained block hashes over token blocks.

The hash of a block covers its tokens and, through its parent, every token before it, so one
hash identifies a whole prefix. Hashes are 64-bit ints from BLAKE2b: deterministic across
processes and machines (no PYTHONHASHSEED dependence), so every actor agrees on them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

ROOT_HASH = 0x5EED_0F_C4A1_5EED  # the parent of every first block
_MASK64 = (1 << 64) - 1


def hash_block(parent: int, tokens: Sequence[int]) -> int:
    """The chained hash of one block of tokens whose preceding blocks hash to ``parent``."""
    h = blake2b(digest_size=8)
    h.update((parent & _MASK64).to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def extend_hashes(hashes: list[int], tokens: Sequence[int], block_size: int) -> list[int]:
    """Append the hashes of the full blocks of ``tokens`` not yet in ``hashes``; returns it.

    Incremental: only blocks completed since the last call are hashed."""
    n_full = len(tokens) // block_size
    parent = hashes[-1] if hashes else ROOT_HASH
    for b in range(len(hashes), n_full):
        parent = hash_block(parent, tokens[b * block_size : (b + 1) * block_size])
        hashes.append(parent)
    return hashes


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Hashes of every full block of ``tokens``."""
    return extend_hashes([], tokens, block_size)


def parent_hash(hashes: Sequence[int], block_index: int) -> int:
    """The parent hash of block ``block_index`` given the chain ``hashes``."""
    return ROOT_HASH if block_index == 0 else hashes[block_index - 1]
