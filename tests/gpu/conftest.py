"""GPU tests: skipped, all of them, where torch sees no CUDA device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA device (run scripts/gpu_check.sh on a GPU machine)"
    )
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)


@contextlib.contextmanager
def cuda_rank(layout, directory: str = "/dev/shm") -> Iterator:
    """Rank 0 on CUDA with its CPU-pool shard in a file under ``directory`` (tmpfs by default,
    where CUDA page-locks a shared file), shut down, unpinned and its files removed after,
    whatever failed."""
    from raykv.transfer.pool_files import PoolFiles
    from raykv.transfer.rank import build_rank

    files = PoolFiles.new(directory)
    try:
        res = build_rank(layout, 0, "cuda", pool_path=files.path(0))
        try:
            yield res
        finally:
            res.engine.shutdown()
            if res.shared is not None:
                res.shared.unpin()
    finally:
        files.remove()
