"""The namespace of raykv's persistent tiers inside vLLM: what a chunk's bytes depend on besides
its key (see ``engine/tier_namespace.py`` for raykv's own engine). Two vLLM engines that agree
on all of it share chunks (a warm restart, another replica); anything else never reads them."""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from vllm.v1.kv_offload.config import OffloadingConfig

from raykv.transfer.disk_files import FORMAT_VERSION, NAMESPACE_BYTES, ChunkIdentity


def _model(name: str) -> dict[str, Any]:
    if os.path.isdir(name):
        from pathlib import Path

        from raykv.model.checkpoint import fingerprint

        return {
            "checkpoint": os.path.basename(os.path.normpath(name)),
            "weights": fingerprint(Path(name)),
        }
    return {"name": name}


def namespace_parts(config: OffloadingConfig, device: str) -> dict[str, Any]:
    """Everything the namespace covers, as plain data."""
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    parallel = config.parallel
    return {
        "format": FORMAT_VERSION,
        "engine": "vllm",
        "model": _model(config.model.name),
        "dtype": config.model.dtype,
        "kv_cache_layout": config.kv_cache_layout,
        "tokens_per_block": [group.tokens_per_block for group in config.groups],
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "tensor_parallel_size": parallel.tp_size,
        "world_size": parallel.world_size,
        "pipeline_parallel_size": parallel.pp_size,
        "context_parallel": [parallel.pcp_size, parallel.dcp_size],
        # the seed of vLLM's first block hash: engines that disagree never name the same prefix
        "hash_seed": hashlib.sha256(get_none_hash_seed().encode()).hexdigest()[:16],
        "device": device,
    }


def digest(parts: dict[str, Any]) -> bytes:
    return hashlib.blake2b(
        json.dumps(parts, sort_keys=True).encode(), digest_size=NAMESPACE_BYTES
    ).digest()


def directory_name(parts: dict[str, Any]) -> str:
    """A readable label and the start of the digest."""
    model = parts["model"].get("checkpoint") or parts["model"].get("name", "model")
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", str(model))[:48]
    tp = parts["tensor_parallel_size"]
    return f"vllm-{label}-{parts['dtype']}-tp{tp}-{digest(parts)[:10].hex()}"


def identity(parts: dict[str, Any], rank: int) -> ChunkIdentity:
    return ChunkIdentity(digest(parts), rank, parts["world_size"])
