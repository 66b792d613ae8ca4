"""vLLM's offload keys as raykv's.

vLLM names a chunk by ``OffloadKey``: its block hash (32 bytes of SHA-256 by default) and a
4-byte KV-group index. raykv's tiers key chunks by one int of a 64-bit hash and an 8-bit group
(``core/keys.py``), which is also what its files and store objects are named by. The first 8
bytes of vLLM's hash are as good a 64-bit hash as any; a collision between two of a tier's
chunks (about one in 2^64 per pair) could at worst serve one prefix's KV for another, which the
chunk's header, carrying the same key, cannot tell apart either: the same bound raykv's own
engine lives with.
"""

from __future__ import annotations

from raykv.core.keys import MAX_GROUPS, make_key

_GROUP_BYTES = 4


def raykv_key(key: bytes) -> int:
    """raykv's key of a vLLM ``OffloadKey``."""
    group = int.from_bytes(key[-_GROUP_BYTES:], "big")
    if group >= MAX_GROUPS:
        raise ValueError(f"KV group {group} is past the {MAX_GROUPS} groups raykv keys carry")
    return make_key(int.from_bytes(key[:8], "big"), group)
