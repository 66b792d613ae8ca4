"""Everything one rank holds, built for its device: KV shard, CPU-pool shard, transfer engine,
model shard."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from raykv.transfer.cpu import CpuTransferEngine
from raykv.transfer.cuda import CudaTransferEngine
from raykv.transfer.layout import KVLayout, allocate_kv, allocate_pool
from raykv.transfer.model import SyntheticModel


@dataclass(slots=True)
class RankResources:
    kv: torch.Tensor
    pool: torch.Tensor
    engine: CpuTransferEngine | CudaTransferEngine
    model: SyntheticModel


def build_rank(
    layout: KVLayout,
    rank: int,
    tp_size: int,
    device: str,
    *,
    threaded: bool = True,
    exec_delay: Callable[[int], int] | None = None,
    copy_fails: Callable[[], bool] | None = None,
) -> RankResources:
    """``device`` is ``cpu`` or ``cuda``. CUDA ranks take GPU ``rank % device_count`` (under Ray
    each rank sees only its own GPU, device 0; ranks in one process share the GPUs there are) and
    a pinned pool."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"parallel.device: cuda, but torch {torch.__version__} sees no CUDA device"
            )
        if exec_delay is not None:
            raise ValueError("exec_delay is a CPU-engine test hook; pause() works on CUDA")
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        kv = allocate_kv(layout, dev)
        pool = allocate_pool(layout, pin=True)
        engine: CpuTransferEngine | CudaTransferEngine = CudaTransferEngine(
            kv, pool, layout, fail=copy_fails
        )
        return RankResources(kv, pool, engine, SyntheticModel(layout, rank, tp_size, device=dev))
    if device != "cpu":
        raise ValueError(f"parallel.device must be cpu or cuda, got {device!r}")
    kv = allocate_kv(layout)
    pool = allocate_pool(layout)
    engine = CpuTransferEngine(
        kv, pool, layout, threaded=threaded, exec_delay=exec_delay, fail=copy_fails
    )
    return RankResources(kv, pool, engine, SyntheticModel(layout, rank, tp_size))
