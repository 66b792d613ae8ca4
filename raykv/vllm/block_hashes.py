"""A prompt's block hashes as vLLM computes them, for the router in front of vLLM replicas.

vLLM names each full block of a prompt by a chained hash: the block's token ids, the hash of
the block before it (for the first, ``NONE_HASH``, the hash of a seed) and the block's extra
keys (the request's ``cache_salt`` on the first block). The hash function is the engine's
``prefix_caching_hash_algo``; the seed is ``PYTHONHASHSEED`` where set, else vLLM's fixed
default for the cryptographic ones (a random one per process for the xxhash ones, which is why
``raykv serve`` then gives every replica one seed). This module chains vLLM's own hash
functions as vLLM does, with the seed passed in, so the router hashes a prompt to exactly the
hashes its replicas' KV events name (``tests/vllm/test_vllm_events.py`` checks that they agree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

_LOW_64 = (1 << 64) - 1


# vLLM's seed where PYTHONHASHSEED is not set (``kv_cache_utils.DEFAULT_NONE_HASH_SEED``;
# tests/vllm/test_vllm_events.py checks it is still vLLM's)
DEFAULT_SEED = "vllm-none-hash"


@lru_cache(maxsize=8)
def _hashing(algo: str, seed: str | None) -> tuple[Callable[[Any], bytes], bytes]:
    # vLLM's hash functions alone (4-5 s to import); its cache utilities take twice that
    from vllm.utils.hashing import get_hash_fn_by_name

    hash_fn = get_hash_fn_by_name(algo)
    return hash_fn, hash_fn(seed if seed is not None else DEFAULT_SEED)


def prompt_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    algo: str = "sha256",
    seed: str | None = None,
) -> list[int]:
    """The low 64 bits of vLLM's hash of each full block of ``token_ids`` (what raykv's KV
    keys of vLLM's blocks hold), under ``cache_salt`` and the engine's hash ``algo`` and
    ``seed`` (None: vLLM's default seed, what a cryptographic algo gets without
    PYTHONHASHSEED)."""
    hash_fn, parent = _hashing(algo, seed)
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        # vLLM's hash_block_tokens: (parent, the block's tokens, its extra keys), hashed
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        parent = hash_fn((parent, tuple(token_ids[start : start + block_size]), extra))
        out.append(int.from_bytes(parent[-8:], "big") & _LOW_64)
    return out


def warm(algo: str, seed: str | None) -> None:
    """Import vLLM's hashing now (a router does it in a thread of its own at start)."""
    _hashing(algo, seed)
