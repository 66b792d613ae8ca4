"""Run a workload through an engine and summarise it (the report of ``raykv run``)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from raykv.core.request import Request
from raykv.engine.core import EngineCore
from raykv.workload.requests import RequestSpec

Progress = Callable[[int, EngineCore], None]  # (requests finished so far, engine)


class RunStalled(RuntimeError):
    """The engine stopped making progress (a bug: every wait in raykv is bounded)."""


def output_digest(requests: Sequence[Request]) -> str:
    """SHA-256 over every request's generated tokens, in request order."""
    h = hashlib.sha256()
    for req in sorted(requests, key=lambda r: r.index):
        h.update(f"{req.req_id}:{','.join(map(str, req.output))};".encode())
    return h.hexdigest()


def run_workload(
    engine: EngineCore,
    specs: Sequence[RequestSpec],
    *,
    progress: Progress | None = None,
    check_invariants: bool = False,
    max_idle_steps: int = 100_000,
) -> dict[str, Any]:
    """Feed ``specs`` to ``engine`` as they arrive (one step is one time unit) and step until
    every request has finished and every transfer has been acknowledged."""
    pending = sorted(enumerate(specs), key=lambda item: (item[1].arrival, item[0]))
    requests: list[Request] = []
    rejected: list[dict[str, str]] = []
    next_spec = 0
    start = time.perf_counter()
    idle = 0
    done = 0
    while next_spec < len(pending) or engine.has_work():
        now = engine.totals.steps
        if not engine.has_work() and next_spec < len(pending):
            now = max(now, pending[next_spec][1].arrival)  # nothing to do: jump to the next one
        while next_spec < len(pending) and pending[next_spec][1].arrival <= now:
            index, spec = pending[next_spec]
            next_spec += 1
            try:
                req = Request(spec.req_id, index, list(spec.prompt), spec.max_tokens)
                engine.add_request(req)
            except ValueError as exc:  # this request is at fault; the run goes on without it
                rejected.append({"request": spec.req_id, "error": str(exc)})
                continue
            requests.append(req)
        finished = engine.step()
        if check_invariants:
            engine.check_invariants()
        done += len(finished)
        idle = 0 if finished or engine.scheduler.running else idle + 1
        if idle > max_idle_steps:
            raise RunStalled(f"no progress for {idle} steps ({done} of {len(specs)} finished)")
        if progress is not None:
            progress(done, engine)
    report = build_report(engine, requests, time.perf_counter() - start)
    report["rejected"] = rejected
    return report


def build_report(engine: EngineCore, requests: list[Request], seconds: float) -> dict[str, Any]:
    t = engine.totals
    tr = t.transfer
    s = engine.scheduler.stats
    c = engine.connector.stats if engine.connector is not None else None
    report: dict[str, Any] = {
        "requests_finished": sum(1 for r in requests if r.finished),
        "requests": len(requests),
        "prompt_tokens": t.prompt_tokens,
        "generated_tokens": t.generated_tokens,
        "gpu_hit_tokens": s.gpu_hit_tokens,
        "cpu_hit_tokens": s.cpu_hit_tokens,
        "recomputed_tokens": s.recomputed_tokens,
        "loads": {
            "jobs": c.load_jobs if c else 0,
            "blocks": c.load_blocks if c else 0,
            "bytes": tr.load_bytes,
            "seconds": tr.load_seconds,
        },
        "stores": {
            "jobs": c.store_jobs if c else 0,
            "blocks": c.store_blocks if c else 0,
            "bytes": tr.store_bytes,
            "seconds": tr.store_seconds,
        },
        "flushes": {
            "reuse": c.flushes_reuse if c else 0,
            "preemption": c.flushes_preemption if c else 0,
            "reset": c.flushes_reset if c else 0,
        },
        "preemptions": s.preemptions,
        "deferred_lookups": c.deferred_lookups if c else 0,
        "allocation_failures": c.allocation_failures if c else 0,
        "integrity": {"blocks_verified": tr.blocks_verified, "mismatches": tr.mismatches},
        "output_digest": output_digest(requests),
        "steps": t.steps,
        "idle_steps": t.idle_steps,
        "wall_seconds": seconds,
    }
    if engine.connector is not None:
        d = engine.connector.directory.stats()
        report["cpu_tier"] = {
            "slots": d.capacity,
            "used": d.used,
            "evictions": d.evictions,
            "policy": d.policy,
        }
        j = engine.connector.jobs.stats
        report["acks"] = {
            "acks": j.acks,
            "unknown": j.unknown,
            "stale": j.stale,
            "duplicate": j.duplicate,
        }
    return report
