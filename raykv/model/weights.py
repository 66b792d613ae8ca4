"""Checkpoint tensors: a Hugging Face directory's safetensors files, or a GGUF file's tensors
dequantized once and kept on disk as safetensors.

Tensors are read lazily: the decoder takes each one by name and slices out its rank's shard,
and only that shard's bytes are read from the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from raykv.model.checkpoint import (
    KEPT_CONFIG_VERSION,
    cached_gguf_config,
    gguf_identity,
    open_safetensors,
    read_spec,
    safetensors_files,
)
from raykv.model.spec import ModelSpec

log = logging.getLogger(__name__)


class SafetensorsWeights(Mapping[str, Any]):
    """The tensors of safetensors files by name, each a lazy slice: index it (``w[rows]``,
    ``w[:, columns]``, ``w[:]``) to read that part."""

    def __init__(self, files: list[Path]) -> None:
        self._files = [open_safetensors(f, framework="pt") for f in files]
        self._where: dict[str, Any] = {}
        for f in self._files:
            names: list[str] = f.keys()  # a safetensors handle is not a dict: no iteration
            self._where.update(dict.fromkeys(names, f))

    def __getitem__(self, name: str) -> Any:
        return self._where[name].get_slice(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_hf_directory(path: str | Path) -> tuple[ModelSpec, Mapping[str, Any]]:
    """The model's description and its tensors (lazy) from a Hugging Face directory."""
    root = Path(path)
    return read_spec(root), SafetensorsWeights(safetensors_files(root))


def cached_gguf_path(path: Path, cache_dir: str | Path) -> Path:
    """Where the dequantized tensors of the GGUF file ``path`` are kept (named by
    ``gguf_identity``), with the model's config in the file's metadata."""
    return Path(cache_dir) / "weights" / f"{path.stem}-{gguf_identity(path)}.safetensors"


def _cached_config(target: Path) -> dict[str, Any] | None:
    """The config kept in a weights-cache entry, or None where it has none of this raykv's
    (``KEPT_CONFIG_VERSION``): the driver and the ranks read the same version of it."""
    with open_safetensors(target) as file:
        metadata = file.metadata() or {}
    if "config" not in metadata or metadata.get("config_version") != str(KEPT_CONFIG_VERSION):
        return None
    return json.loads(metadata["config"])


def load_gguf_weights(
    path: Path, cache_dir: str | Path | None
) -> tuple[ModelSpec, Mapping[str, Any]]:
    """The model's description and its tensors from a GGUF file: from the on-disk cache of its
    dequantized tensors, made on first use (one process makes it; the others wait for it and
    read it). Without a cache directory, or when it cannot be written, every tensor is
    dequantized into memory."""
    from raykv.model.gguf_file import load_gguf

    if cache_dir is None:
        spec, weights, _ = load_gguf(path)
        return spec, weights
    target = cached_gguf_path(path, cache_dir)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target.with_suffix(".lock")):
            if not target.is_file():
                spec, weights, config = load_gguf(path)
                partial = target.with_suffix(f".partial-{os.getpid()}")
                metadata = {
                    "source": str(path),
                    "config": json.dumps(config),
                    "config_version": str(KEPT_CONFIG_VERSION),
                }
                save_file(dict(weights), str(partial), metadata=metadata)
                os.replace(partial, target)  # whole or absent, never half written
                return spec, weights
    except OSError as exc:
        log.warning(
            "cannot cache dequantized weights in %s (%s): keeping them in memory", cache_dir, exc
        )
        spec, weights, _ = load_gguf(path)
        return spec, weights
    # the config kept beside the tensors: reading it from the GGUF file again means parsing its
    # whole vocabulary (seconds per rank for a 49k-token one)
    config = _cached_config(target)
    if config is None:  # an entry made before configs (or this version of them) were kept in it
        config = cached_gguf_config(path, cache_dir)
    return ModelSpec.from_hf_config(config, path), SafetensorsWeights([target])


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
