"""Offload keys: one compact int per (chunk, KV group).

A key packs the chunk's chained block hash (the hash of the last block in the chunk, which
identifies the whole prefix up to the chunk's end) with the KV-group index. Ints hash and compare
faster than tuples or bytes and create no per-key container objects.
"""

from __future__ import annotations

GROUP_BITS = 8
MAX_GROUPS = 1 << GROUP_BITS
_GROUP_MASK = MAX_GROUPS - 1


def make_key(block_hash: int, group: int = 0) -> int:
    """Pack a non-negative block hash and a group index (0..255) into one key."""
    if block_hash < 0:
        raise ValueError(f"block hash must be non-negative, got {block_hash}")
    if not 0 <= group < MAX_GROUPS:
        raise ValueError(f"group index must be in [0, {MAX_GROUPS}), got {group}")
    return (block_hash << GROUP_BITS) | group


def key_hash(key: int) -> int:
    """The block hash a key was made from."""
    return key >> GROUP_BITS


def key_group(key: int) -> int:
    """The KV-group index a key was made from."""
    return key & _GROUP_MASK
