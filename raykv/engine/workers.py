"""An in-process worker group: every tensor-parallel rank in this process, one after another.

Each rank owns its shard of the KV cache (its KV heads of every block), its shard of the CPU
pool, a transfer engine, the model's shard and the connector's worker half. The Ray deployment
wraps exactly these objects in actors.
"""

from __future__ import annotations

from collections.abc import Callable

from raykv.config import RaykvConfig
from raykv.connector.plan import StepPlan, StepReport
from raykv.connector.worker import AckDelay, ConnectorWorker
from raykv.transfer.layout import KVLayout
from raykv.transfer.rank import build_rank

ExecDelay = Callable[[int], int]  # job id -> steps its copy stays pending (unthreaded engines)


def make_layout(cfg: RaykvConfig, num_slots: int) -> KVLayout:
    return KVLayout(
        num_gpu_blocks=cfg.cache.num_gpu_blocks,
        block_size=cfg.cache.block_size,
        num_groups=len(cfg.cache.groups),
        layers_per_group=cfg.layers_per_group,
        kv_heads=cfg.kv_heads_per_rank,
        head_dim=cfg.model.head_dim,
        dtype=cfg.model.dtype,
        blocks_per_chunk=cfg.offload.blocks_per_chunk,
        num_slots=max(1, num_slots),
    )


class LocalWorker:
    """One rank, in this process."""

    def __init__(
        self,
        cfg: RaykvConfig,
        rank: int,
        num_slots: int,
        ack_delay: AckDelay | None = None,
        exec_delay: ExecDelay | None = None,
        threaded: bool = True,
    ) -> None:
        self.rank = rank
        self.layout = make_layout(cfg, num_slots)
        res = build_rank(
            self.layout,
            rank,
            cfg.parallel.tensor_parallel_size,
            cfg.parallel.device,
            threaded=threaded,
            exec_delay=exec_delay,
        )
        self.kv, self.pool, self.engine, self.model = res.kv, res.pool, res.engine, res.model
        self.connector = ConnectorWorker(rank, self.engine, self.model, self.kv, ack_delay)

    def execute(self, plan: StepPlan) -> StepReport:
        return self.connector.execute(plan)

    def shutdown(self) -> None:
        self.engine.shutdown()


class LocalWorkerGroup:
    """Every rank in this process; ``execute`` runs a plan on each and gathers the reports."""

    def __init__(
        self,
        cfg: RaykvConfig,
        num_slots: int,
        ack_delays: dict[int, AckDelay] | None = None,
        exec_delays: dict[int, ExecDelay] | None = None,
        threaded: bool = True,
    ) -> None:
        """``ack_delays`` / ``exec_delays`` (per rank) hold completions back or keep copies
        really pending for a number of steps; with ``threaded=False`` copies run only at each
        step's poll, so a seeded test reproduces the same interleaving every time."""
        acks, execs = ack_delays or {}, exec_delays or {}
        self.workers = [
            LocalWorker(cfg, rank, num_slots, acks.get(rank), execs.get(rank), threaded)
            for rank in range(cfg.parallel.tensor_parallel_size)
        ]

    @property
    def num_ranks(self) -> int:
        return len(self.workers)

    def execute(self, plan: StepPlan) -> list[StepReport]:
        return [w.execute(plan) for w in self.workers]

    def for_each(self, fn: Callable[[LocalWorker], None]) -> None:
        for w in self.workers:
            fn(w)

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()

    def __enter__(self) -> LocalWorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
