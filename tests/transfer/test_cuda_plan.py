"""The CUDA engine's copy planning, which is plain Python and testable without a GPU."""

from __future__ import annotations

import pytest
import torch

from raykv.transfer.copy_plan import host_runs
from raykv.transfer.cuda import CudaTransferEngine
from raykv.transfer.layout import KVLayout, allocate_kv, allocate_pool


@pytest.mark.parametrize(
    "host,dev,expected",
    [
        ([0, 1, 2], [5, 6, 7], [(0, 3, True)]),  # one slice copy
        ([0, 1, 2], [7, 5, 6], [(0, 3, False)]),  # one gather/scatter around one copy
        ([0, 1, 5, 6], [3, 4, 9, 1], [(0, 2, True), (2, 4, False)]),
        ([2, 4, 6], [0, 1, 2], [(0, 1, True), (1, 2, True), (2, 3, True)]),  # scattered host
        ([], [], []),
    ],
)
def test_runs_split_on_host_rows(host, dev, expected) -> None:
    assert host_runs(host, dev) == expected


def test_engine_refuses_a_kv_cache_in_host_memory() -> None:
    layout = KVLayout(4, 4, 1, 1, 1, 4, "float16", 1, 4)
    with pytest.raises(ValueError, match="CUDA device"):
        CudaTransferEngine(allocate_kv(layout), allocate_pool(layout), layout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_cuda_ranks_without_cuda_are_a_clear_error() -> None:
    from raykv.transfer.rank import build_rank

    layout = KVLayout(4, 4, 1, 1, 1, 4, "float16", 1, 4)
    with pytest.raises(RuntimeError, match="sees no CUDA device"):
        build_rank(layout, 0, "cuda")
