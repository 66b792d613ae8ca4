"""Chained block hashes over token blocks.

The hash of a block covers its tokens and, through its parent, every token before it, so one
hash identifies a whole prefix. Hashes are 64-bit ints from BLAKE2b: deterministic across
processes and machines (no PYTHONHASHSEED dependence), so every actor agrees on them.

A request's ``cache_salt`` (a tenant's, say) is the parent of its first block
(``salted_root``): requests with different salts share no block hash, so no block of one is
ever a hit for the other, in any tier or in a router's view; without a salt the chain starts
at ``ROOT_HASH`` as it always did.
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


MAX_SALT_CHARS = 1024


def check_cache_salt(value: object) -> str:
    """``value`` as a cache salt: a non-empty string of at most ``MAX_SALT_CHARS`` characters;
    ``ValueError`` saying what is wrong otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"cache_salt must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError("cache_salt must not be empty (leave it out for no salt)")
    if len(value) > MAX_SALT_CHARS:
        raise ValueError(f"cache_salt of {len(value)} characters: at most {MAX_SALT_CHARS}")
    return value


def salted_root(cache_salt: str | None) -> int:
    """The parent of a request's first block: ``ROOT_HASH`` without a salt, else a hash of
    the salt (never ``ROOT_HASH``: an empty salt is no salt)."""
    if not cache_salt:
        return ROOT_HASH
    h = blake2b(digest_size=8, person=b"raykv-salt")
    h.update(cache_salt.encode("utf-8", "surrogatepass"))
    root = int.from_bytes(h.digest(), "little")
    return root if root != ROOT_HASH else root ^ 1


def extend_hashes(
    hashes: list[int], tokens: Sequence[int], block_size: int, root: int = ROOT_HASH
) -> list[int]:
    """Append the hashes of the full blocks of ``tokens`` not yet in ``hashes`` (a chain that
    starts at ``root``); returns it.

    Incremental: only blocks completed since the last call are hashed."""
    n_full = len(tokens) // block_size
    parent = hashes[-1] if hashes else root
    for b in range(len(hashes), n_full):
        parent = hash_block(parent, tokens[b * block_size : (b + 1) * block_size])
        hashes.append(parent)
    return hashes


def block_hashes(tokens: Sequence[int], block_size: int, root: int = ROOT_HASH) -> list[int]:
    """Hashes of every full block of ``tokens`` (a chain that starts at ``root``)."""
    return extend_hashes([], tokens, block_size, root)


def parent_hash(hashes: Sequence[int], block_index: int, root: int = ROOT_HASH) -> int:
    """The parent hash of block ``block_index`` given the chain ``hashes`` (started at
    ``root``)."""
    return root if block_index == 0 else hashes[block_index - 1]
