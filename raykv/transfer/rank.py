"""What one rank holds for its device: KV shard, CPU-pool shard and transfer engine (the model
that computes on the KV is the engine's to choose: ``engine/workers.py``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from raykv.transfer.cpu import CpuTransferEngine
from raykv.transfer.cuda import CudaTransferEngine
from raykv.transfer.layout import KVLayout, allocate_kv, allocate_pool
from raykv.transfer.populate import PagePopulator, populate_in_background
from raykv.transfer.shared_pool import SharedPool, SharedPoolUnavailable, filesystem_type

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RankResources:
    kv: torch.Tensor
    pool: torch.Tensor
    engine: CpuTransferEngine | CudaTransferEngine
    shared: SharedPool | None = None  # the pool's file, when the shard is in shared memory

    @property
    def pool_attached(self) -> bool:
        """The pool is a dead predecessor's shard, its finished chunks intact."""
        return self.shared is not None and self.shared.attached


def build_rank(
    layout: KVLayout,
    rank: int,
    device: str,
    *,
    threaded: bool = True,
    exec_delay: Callable[[int], int] | None = None,
    pool_path: str | None = None,
) -> RankResources:
    """``device`` is ``cpu`` or ``cuda``. CUDA ranks take GPU ``rank % device_count`` (under Ray
    each rank sees only its own GPU, device 0; ranks in one process share the GPUs there are) and
    a pinned pool. With ``pool_path`` the pool is that shared-memory file (see
    :mod:`raykv.transfer.shared_pool`), created or, after a restart, attached."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"parallel.device: cuda, but torch {torch.__version__} sees no CUDA device"
            )
        if exec_delay is not None:
            raise ValueError("exec_delay is a CPU-engine test hook; pause() works on CUDA")
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        kv = allocate_kv(layout, dev)
        shared = _shared_pool(pool_path, layout, rank)
        if shared is not None and not shared.pin():
            log.warning(
                "rank %d: CUDA cannot page-lock %s (a shared file on %s; Linux pins shared files "
                "for DMA on tmpfs such as /dev/shm only): pinning a private pool, which a "
                "replaced rank does not find again (offload.shared_pool_dir)",
                rank,
                pool_path,
                filesystem_type(pool_path),
            )
            shared.unlink()
            shared = None
        pool = shared.tensor if shared is not None else allocate_pool(layout, pin=True)
        sums = shared.sums if shared is not None else None
        engine: CpuTransferEngine | CudaTransferEngine = CudaTransferEngine(
            kv, pool, layout, sums=sums
        )
        return RankResources(kv, pool, engine, shared)
    if device != "cpu":
        raise ValueError(f"parallel.device must be cpu or cuda, got {device!r}")
    kv = allocate_kv(layout)
    shared = _shared_pool(pool_path, layout, rank)
    pool = shared.tensor if shared is not None else allocate_pool(layout)
    sums = shared.sums if shared is not None else None
    engine = CpuTransferEngine(
        kv, pool, layout, threaded=threaded, exec_delay=exec_delay, sums=sums
    )
    return RankResources(kv, pool, engine, shared)


def _shared_pool(path: str | None, layout: KVLayout, rank: int) -> SharedPool | None:
    """The shard in shared memory, or None (private memory) when there is no room for it: a
    rank that cannot keep its shard across a restart still serves, as Ray's object store falls
    back from a small /dev/shm."""
    if not path:
        return None
    try:
        return SharedPool(path, layout)
    except SharedPoolUnavailable as exc:
        log.warning("rank %d keeps its CPU-pool shard in private memory: %s", rank, exc)
        return None


@dataclass(slots=True)
class PieceCopies:
    """The CPU-pool shard and the copy engine of a rank whose pages are pieces of another
    engine's cache (vLLM's canonical per-layer views), and the thread faulting the pool in."""

    pool: torch.Tensor
    engine: CpuTransferEngine | CudaTransferEngine
    populator: PagePopulator | None


def piece_copies(
    pieces: list[torch.Tensor], layout: KVLayout, *, threaded: bool, sharers: int = 1
) -> PieceCopies:
    """Pieces on a GPU: a pinned pool and raykv's CUDA engine (streams ordered after the compute
    stream, events). Pieces in host memory: a pool faulted in in the background and the CPU
    engine (a copy thread of its own only where ``threaded``; ``sharers``: the ranks on this
    node faulting their pools in at the same time). Anything else is refused, naming the
    device."""
    device = pieces[0].device if pieces else torch.device("cpu")
    if device.type == "cuda":
        pool = allocate_pool(layout, pin=True)
        return PieceCopies(pool, CudaTransferEngine(pieces, pool, layout), None)
    if device.type != "cpu":
        raise RuntimeError(
            f"raykv copies KV pages on CPU and CUDA devices; this cache is on {device}"
        )
    pool = allocate_pool(layout)
    engine = CpuTransferEngine(pieces, pool, layout, threaded=threaded)
    # its pages faulted in now, in the background, not by the first copies and promotions into
    # each slot (``transfer/populate.py``)
    return PieceCopies(pool, engine, populate_in_background(pool, sharers))
