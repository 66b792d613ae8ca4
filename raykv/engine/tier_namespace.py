"""What names a chunk's bytes across runs and nodes: the namespace of the persistent tiers.

A chunk's key says which tokens it holds; whether its bytes are the KV a run would compute for
them depends on everything else: the model (its weights' fingerprint for a checkpoint, the
synthetic model's geometry otherwise), the dtype, the KV layout a rank's page has (groups, their
attention kinds and windows, layers per page, heads per rank, head size), the block size, the
blocks per chunk, the TP size (a rank's file holds its heads only), the device (CPU and CUDA
kernels may round differently) and the on-disk format's version. A run reads only chunk files
under its own namespace, so a different model, dtype, layout or TP size never reads another's
bytes, and two runs that agree on all of it share.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from functools import lru_cache
from typing import Any

from raykv.config import ConfigError, RaykvConfig
from raykv.transfer.disk_files import (
    FORMAT_VERSION,
    NAMESPACE_BYTES,
    ChunkIdentity,
    private_directory,
)


def namespace_parts(cfg: RaykvConfig) -> dict[str, Any]:
    """Everything the namespace covers, as plain data (written beside the files for whoever
    looks at the directory)."""
    m, c, o = cfg.model, cfg.cache, cfg.offload
    if m.path is not None:
        from raykv.model.checkpoint import resolve

        path = resolve(m.path)
        model: dict[str, Any] = {"checkpoint": path.name, "weights": _fingerprint(str(path))}
    else:
        model = {"synthetic": 1, "layers": m.num_layers, "vocab_size": m.vocab_size}
    return {
        "format": FORMAT_VERSION,
        "model": model,
        "dtype": m.dtype,
        "groups": [[g.kind, g.window_tokens] for g in c.groups],
        "layers_per_page": cfg.layers_per_group,
        "kv_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "block_size": c.block_size,
        "blocks_per_chunk": o.blocks_per_chunk,
        "tensor_parallel_size": cfg.parallel.tensor_parallel_size,
        # the same model's KV computed by another device's kernels may differ in its last bits
        "device": cfg.parallel.device,
    }


def _digest(parts: dict[str, Any]) -> bytes:
    return hashlib.blake2b(
        json.dumps(parts, sort_keys=True).encode(), digest_size=NAMESPACE_BYTES
    ).digest()


def namespace_digest(cfg: RaykvConfig) -> bytes:
    """The digest of ``namespace_parts``: what every chunk's header carries."""
    return _digest(namespace_parts(cfg))


def namespace(cfg: RaykvConfig) -> str:
    """The namespace's directory name: a readable label and (the start of) its digest."""
    parts = namespace_parts(cfg)
    model = parts["model"].get("checkpoint", "synthetic")
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", str(model))[:48]
    tp = parts["tensor_parallel_size"]
    return f"{label}-{parts['dtype']}-tp{tp}-{_digest(parts)[:10].hex()}"


def chunk_identity(cfg: RaykvConfig, rank: int) -> ChunkIdentity:
    """What ``rank``'s part of every chunk of this run is (its headers say it on every tier)."""
    return ChunkIdentity(namespace_digest(cfg), rank, cfg.parallel.tensor_parallel_size)


def disk_rank_root(cfg: RaykvConfig, rank: int) -> str:
    """Where ``rank`` keeps its disk-tier files: ``<path>/<namespace>/rank-<rank>``."""
    path = cfg.offload.disk.path
    if path is None:
        raise ValueError("offload.disk.path is not set")
    return os.path.join(os.path.expanduser(path), namespace(cfg), f"rank-{rank}")


def describe(cfg: RaykvConfig) -> None:
    """Write ``namespace.json`` beside the ranks' directories (what the name stands for), the
    directories made this user's only; ``ConfigError`` naming ``offload.disk.path`` where they
    cannot be made."""
    root = os.path.dirname(disk_rank_root(cfg, 0))
    target = os.path.join(root, "namespace.json")
    try:
        private_directory(root)
        fd, tmp = tempfile.mkstemp(prefix=".namespace.", suffix=".tmp", dir=root)
        with os.fdopen(fd, "w") as fh:
            json.dump(namespace_parts(cfg), fh, indent=2, sort_keys=True)
        os.replace(tmp, target)
    except OSError as exc:
        raise ConfigError(
            f"offload.disk.path: cannot use {cfg.offload.disk.path!r}: "
            f"{exc.strerror or exc} ({exc.filename or root})"
        ) from None


@lru_cache(maxsize=8)
def _fingerprint(path: str) -> str:
    from pathlib import Path

    from raykv.model.checkpoint import fingerprint

    return fingerprint(Path(path))
