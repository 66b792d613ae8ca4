#!/usr/bin/env python3
"""Soak: thousands of requests with random faults, memory sampled as it goes, books drained.

Runs a synthetic multi-turn workload through the engine (one process, or on Ray with
``--engine ray``) with a mix of injected faults (dead ranks, lost, duplicated and late acks,
failed copies), verify mode on, and the scheduler's invariants checked every ``--check-every``
steps. Samples the resident memory (RSS) of this process every ``--sample-every`` finished
requests. Passes when every request finished, no loaded block mismatched, the books of the live
engine drained once the run ended (no job in the table, nothing fenced, no request state left,
no CPU-tier slot being written or read, no GPU block held: see ``drain_problems``) and memory
stayed bounded: the last sample within 25% (+32 MiB) of the one taken after the first tenth of
the run.

Usage: python scripts/soak.py --requests 10000 [--engine local|ray] [--tp 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import psutil

from raykv.config import load_config
from raykv.engine.core import EngineCore
from raykv.engine.stats import drain_books
from raykv.engine.workers import LocalWorkerGroup
from raykv.runs.driver import Driver
from raykv.workload.requests import make_workload

DEFAULT_FAULTS = [
    "kill-worker:rate=0.001:seed=11",
    "drop-acks:rate=0.02:seed=12",
    "dup-acks:rate=0.02:seed=13",
    "fail-copy:rate=0.02:seed=14",
    "delay-acks:rank=0:steps=3",
]


# what the books must hold once a run has drained (DESIGN invariant 4), all of them present
DRAINED = {
    "jobs": 0,  # transfer jobs in the job table
    "fence": 0,  # GPU blocks fenced by unfinished stores
    "tracked": 0,  # per-request connector states
    "writing": 0,  # CPU-tier slots being written
    "reading": 0,  # CPU-tier slots being read
    "loading": 0,  # requests still waiting for a load
    "gpu_blocks_leaked": 0,  # GPU blocks not free
}


def books_of(engine: EngineCore) -> dict[str, int]:
    """The books of a live one-process engine, read now."""
    if engine.connector is None:
        raise SystemExit("soak needs offloading on: there are no books to check")
    return drain_books(engine)


def ray_books(server) -> dict[str, int]:
    """The books of the live scheduler actor (``EngineServer.books``), in ``books_of``'s keys."""
    import ray

    return dict(ray.get(server.books.remote(), timeout=60))


def drain_problems(books: dict[str, int]) -> list[str]:
    """What keeps ``books`` from being drained; empty when they are. A key that is missing is
    a problem too: books that say nothing have not been read."""
    return [
        f"{key} = {books[key]}" if key in books else f"{key} missing from the books"
        for key, want in DRAINED.items()
        if books.get(key) != want
    ]


def config(args: argparse.Namespace):
    faults = args.fault if args.fault is not None else DEFAULT_FAULTS
    return load_config(
        None,
        [
            f"workload.num_requests={args.requests}",
            f"parallel.tensor_parallel_size={args.tp}",
            "model.head_dim=8",
            "cache.num_gpu_blocks=96",
            "workload.max_tokens=8",
            "workload.system_prompt_tokens=96",
            "workload.user_tokens=24",
            "workload.answer_tokens=16",
            "workload.concurrent_conversations=24",
            "engine.keep_finished=false",
            "offload.verify=true",
            "faults=[" + ",".join(f'"{f}"' for f in faults) + "]",
        ],
    )


def soak_local(args: argparse.Namespace) -> dict:
    cfg = config(args)
    proc = psutil.Process()
    samples: list[tuple[int, int]] = []
    with LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers:
        engine = EngineCore(cfg, workers)
        driver = Driver(engine)
        driver.submit(make_workload(cfg))
        steps = 0
        while driver.has_work():
            driver.step(max_idle_steps=20_000)
            driver.take_finished()
            steps += 1
            if steps % args.check_every == 0:
                engine.check_invariants()
            done = driver.finished_count
            if done and (not samples or done - samples[-1][0] >= args.sample_every):
                samples.append((done, proc.memory_info().rss))
                if not args.quiet:
                    print(
                        f"{done:>7} finished  rss {samples[-1][1] / 2**20:7.1f} MiB  "
                        f"restarts {engine.totals.rank_restarts}",
                        flush=True,
                    )
        engine.check_invariants()
        report = driver.report().as_dict()
        report["books"] = books_of(engine)
        samples.append((driver.finished_count, proc.memory_info().rss))
    report["rss_samples"] = samples
    return report


def soak_ray(args: argparse.Namespace) -> dict:
    from raykv.cluster.client import RaykvClient

    cfg = config(args)
    samples: list[tuple[int, int]] = []
    proc = psutil.Process()

    def progress(p: dict) -> None:
        if not samples or p["finished"] - samples[-1][0] >= args.sample_every:
            samples.append((p["finished"], proc.memory_info().rss))

    with RaykvClient.start(cfg) as client:
        report = client.run(make_workload(cfg), progress=progress)
        # the scheduler that finished the run (a replacement, if one died)
        report["books"] = ray_books(client.server)
    report["rss_samples"] = samples
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--engine", choices=["local", "ray"], default="local")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--fault", action="append", help="fault spec (default: a mix of all kinds)")
    ap.add_argument("--check-every", type=int, default=10, help="steps between book checks")
    ap.add_argument("--sample-every", type=int, default=500, help="requests between RSS samples")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    start = time.perf_counter()
    report = soak_ray(args) if args.engine == "ray" else soak_local(args)
    report["soak_seconds"] = time.perf_counter() - start
    samples = report["rss_samples"]
    warm = samples[min(len(samples) - 1, max(1, len(samples) // 10))][1]
    last = samples[-1][1]
    bounded = last <= warm * 1.25 + 32 * 2**20
    books = report["books"]
    problems = drain_problems(books)
    report["drain_problems"] = problems
    ok = (
        report["requests_finished"] == args.requests - len(report["rejected"])
        and report["integrity"]["mismatches"] == 0
        and not problems
        and bounded
    )
    print(
        f"{'ok' if ok else 'FAIL'}: {report['requests_finished']} requests in "
        f"{report['soak_seconds']:.0f} s, {report['steps']} steps, "
        f"{report['rank_restarts']} rank restarts ({report['tier_kept_restarts']} kept the CPU "
        f"tier), {report['integrity']['blocks_verified']} "
        f"blocks verified, {report['integrity']['mismatches']} mismatches, books {books}, "
        f"rss {warm / 2**20:.0f} -> {last / 2**20:.0f} MiB (max "
        f"{max(s[1] for s in samples) / 2**20:.0f})"
    )
    if problems:
        print(f"books not drained: {', '.join(problems)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
