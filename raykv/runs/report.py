"""The run report: what ``raykv run`` prints and writes (``--json-report``), as one typed record.

It is built once from an engine's stats snapshot when a run ends; whoever drives the run fills
in what only it knows (the engine kind, the refused requests, the config, the per-rank detail
and the scheduler restarts of the Ray client). ``as_dict`` gives the JSON shape docs/running.md
documents.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from msgspec import structs

from raykv.engine.latency import LatencyBook
from raykv.engine.stats import EngineStats
from raykv.runs.tier_report import tier_report


@dataclass(slots=True)
class TransferTotals:
    jobs: int
    blocks: int
    bytes: int
    seconds: float


@dataclass(slots=True)
class Flushes:
    reuse: int = 0
    preemption: int = 0
    reset: int = 0
    timeout: int = 0


@dataclass(slots=True)
class Integrity:
    blocks_verified: int  # synthetic model: loaded blocks compared byte for byte
    mismatches: int  # what the model read wrong (exit status 1)
    checked: int = 0  # loaded CPU-pool rows whose checksum was checked (offload.verify)
    corrupt_detected: int = 0  # of those, caught corrupt: the load failed, nothing was read


@dataclass(slots=True)
class CpuTierSummary:
    slots: int
    used: int
    evictions: int
    policy: str


@dataclass(slots=True)
class AckCounts:
    acks: int
    unknown: int
    stale: int
    duplicate: int


@dataclass(slots=True)
class RunReport:
    requests_finished: int
    requests_admitted: int  # by the engine (refused ones are in ``rejected``)
    prompt_tokens: int
    generated_tokens: int
    admitted_tokens: int  # what each admission had to provide (re-admissions count again)
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    recomputed_tokens: int
    loads: TransferTotals
    stores: TransferTotals
    flushes: Flushes
    preemptions: int
    rank_restarts: int
    tier_kept_restarts: int
    deferral_timeouts: int
    deferred_lookups: int
    allocation_failures: int
    integrity: Integrity
    output_digest: str
    steps: int
    idle_steps: int
    wall_seconds: float
    ranks: list[dict[str, float]]  # transfer stats of each rank
    # wall seconds from arrival (``engine/latency``): {mean, p50, p90, p99}; None: no token
    ttft_s: dict[str, float] | None = None
    itl_s: dict[str, float] | None = None
    throughput: dict[str, float] = field(default_factory=dict)  # tokens per wall second
    prefill_tokens: dict[str, int] = field(default_factory=dict)  # by where they came from
    # per step, mean seconds: the engine's whole step; busy_step_s: the same over the steps
    # that computed tokens (idle ones only poll and ack); the slowest rank's own work in a step
    # (ranks_busy_s), split into its model's (model_s) and the rest (transfers_s: its block
    # tables and its moves' submits, polls and checksums, and on CPU ranks their copies);
    # outside_share: what is not the rank's (scheduling, the control plane) over the step
    step_time: dict[str, float] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)  # each request's first token
    cpu_tier: CpuTierSummary | None = None
    acks: AckCounts | None = None
    rejected: list[dict[str, str]] = field(default_factory=list)
    engine: str | None = None  # "local" or "ray"
    control_plane: str | None = None  # the ray engine's: "graph" or "calls" (the fallback)
    config: dict[str, Any] | None = None
    ranks_detail: list[dict[str, Any]] | None = None
    scheduler_restarts: int | None = None
    samples: list[dict[str, Any]] | None = None  # a chat run's questions and answers
    disk_hit_tokens: int = 0  # tier hits promoted from the disk tier (not in cpu_hit_tokens)
    shared_hit_tokens: int = 0  # ... and from the shared tier (in neither)
    tiers: dict[str, dict[str, Any]] | None = None  # per tier (``runs/tier_report.py``)
    # what the scheduler's choice of tier hits rests on (offload.take_hits: faster)
    tier_costs: dict[str, float] | None = None

    @classmethod
    def build(
        cls,
        stats: EngineStats,
        finished: int,
        digest: str,
        admitted: int,
        seconds: float,
        latency: LatencyBook | None = None,
    ) -> RunReport:
        s, tr, c = stats.scheduler, stats.transfer, stats.connector
        d, a = stats.directory, stats.acks
        times = latency.report() if latency is not None else {}
        wall = max(seconds, 1e-9)
        return cls(
            ttft_s=times.get("ttft_s"),
            itl_s=times.get("itl_s"),
            requests=times.get("requests", []),
            throughput={
                "prompt_tokens_per_s": stats.prompt_tokens / wall,
                "generated_tokens_per_s": stats.generated_tokens / wall,
            },
            prefill_tokens={
                "computed": s.admitted_tokens
                - s.gpu_hit_tokens
                - s.cpu_hit_tokens
                - s.disk_hit_tokens
                - s.shared_hit_tokens,
                "gpu_cache": s.gpu_hit_tokens,
                "cpu_tier": s.cpu_hit_tokens,
                "disk_tier": s.disk_hit_tokens,
                "shared_tier": s.shared_hit_tokens,
            },
            disk_hit_tokens=s.disk_hit_tokens,
            shared_hit_tokens=s.shared_hit_tokens,
            tiers=tier_report(stats, latency.later_than_recompute if latency else {}),
            tier_costs=stats.costs or None,
            step_time=_step_time(stats),
            requests_finished=finished,
            requests_admitted=admitted,
            prompt_tokens=stats.prompt_tokens,
            generated_tokens=stats.generated_tokens,
            admitted_tokens=s.admitted_tokens,
            gpu_hit_tokens=s.gpu_hit_tokens,
            cpu_hit_tokens=s.cpu_hit_tokens,
            recomputed_tokens=s.recomputed_tokens,
            loads=TransferTotals(
                c.load_jobs if c else 0, c.load_blocks if c else 0, tr.load_bytes, tr.load_seconds
            ),
            stores=TransferTotals(
                c.store_jobs if c else 0,
                c.store_blocks if c else 0,
                tr.store_bytes,
                tr.store_seconds,
            ),
            flushes=Flushes(
                c.flushes_reuse, c.flushes_preemption, c.flushes_reset, c.flushes_timeout
            )
            if c
            else Flushes(),
            preemptions=s.preemptions,
            rank_restarts=stats.rank_restarts,
            tier_kept_restarts=stats.tier_kept_restarts,
            deferral_timeouts=c.deferral_timeouts if c else 0,
            deferred_lookups=c.deferred_lookups if c else 0,
            allocation_failures=c.allocation_failures if c else 0,
            integrity=Integrity(
                tr.blocks_verified, tr.mismatches, tr.chunks_checked, tr.corrupt_detected
            ),
            output_digest=digest,
            steps=stats.steps,
            idle_steps=stats.idle_steps,
            wall_seconds=seconds,
            ranks=[structs.asdict(r) for r in stats.per_rank],
            cpu_tier=CpuTierSummary(d.capacity, d.used, d.evictions, d.policy) if d else None,
            acks=AckCounts(a.acks, a.unknown, a.stale, a.duplicate) if a else None,
        )

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape: every field, with the parts a run does not have left out."""
        out = asdict(self)
        optional = (
            "cpu_tier",
            "acks",
            "engine",
            "config",
            "ranks_detail",
            "scheduler_restarts",
            "tiers",
            "tier_costs",
        )
        for key in (*optional, "samples"):
            if out[key] is None:
                del out[key]
        return out


def _step_time(stats: EngineStats) -> dict[str, float]:
    steps = max(stats.steps, 1)
    step, busy = stats.step_seconds / steps, stats.ranks_busy_seconds / steps
    model = stats.ranks_model_seconds / steps
    busy_steps = max(stats.steps - stats.idle_steps, 1)
    return {
        "step_s": step,
        "busy_step_s": stats.busy_step_seconds / busy_steps,
        "ranks_busy_s": busy,
        "model_s": model,
        "transfers_s": busy - model,
        "outside_share": 1.0 - busy / step if step > 0 else 0.0,
    }
