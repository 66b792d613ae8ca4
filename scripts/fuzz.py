#!/usr/bin/env python3
"""Fuzz the one-process engine: random configurations, workloads, copy and ack delays, and
faults, with every invariant checked after every step.

Each episode draws (seeded) 1-4 ranks, one or two KV groups, tiny GPU pools and CPU tiers that
force block reuse, preemption and eviction, a policy, chunk sizes, per-rank seeded delays for
when a copy really runs and when it is acknowledged, and a mix of injected faults (lost,
duplicated and late acks, failed copies, dead ranks, whose replacements find their CPU-pool
shard in shared memory or start empty). It runs the workload with offloading, checking the
scheduler's books after every step (each rank checks the fence before every write), then
requires the drain (no jobs, no fence, no request state, no busy slot, every GPU block free), a
CPU tier whose every readable chunk holds the right bytes on every rank, and the same tokens as
a run without offloading.

Usage: python scripts/fuzz.py --steps 1000000 [--seed S]   (CI runs a short version)
Exit status 1, with the seed and episode to replay, on the first violation.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import time
import traceback

from raykv.config import load_config
from raykv.engine.core import EngineCore
from raykv.engine.run import run_workload
from raykv.engine.workers import LocalWorkerGroup
from raykv.workload.requests import synthetic_chat

GROUPS = [
    "[{kind: full_attention}]",
    "[{kind: full_attention}, {kind: sliding_window, window_tokens: 12}]",
    "[{kind: sliding_window, window_tokens: 20}]",
]


def episode(rng: random.Random) -> tuple[list[str], dict, int]:
    tp = rng.choice([1, 2, 3, 4])
    groups = rng.choice(GROUPS)
    faults = []
    if rng.random() < 0.5:
        faults.append(f"drop-acks:rate={rng.choice([0.05, 0.2])}:seed={rng.randrange(99)}")
    if rng.random() < 0.5:
        faults.append(f"dup-acks:rate={rng.choice([0.05, 0.3])}:seed={rng.randrange(99)}")
    if rng.random() < 0.3:
        faults.append(f"fail-copy:rate={rng.choice([0.05, 0.2])}:seed={rng.randrange(99)}")
    if rng.random() < 0.3:
        faults.append(f"kill-worker:rate={rng.choice([0.005, 0.02])}:seed={rng.randrange(99)}")
    if rng.random() < 0.3:
        faults.append(f"delay-acks:rank={rng.randrange(tp)}:steps={rng.choice([2, 7])}")
    sets = [
        f"parallel.tensor_parallel_size={tp}",
        f"model.num_kv_heads={tp}",
        f"model.num_layers={groups.count('kind')}",
        "model.head_dim=4",
        f"model.eos_every={rng.choice([0, 5])}",
        f"cache.groups={groups}",
        f"cache.block_size={rng.choice([4, 8])}",
        f"cache.num_gpu_blocks={rng.randint(12, 48)}",
        f"offload.blocks_per_chunk={rng.choice([1, 2, 3])}",
        f"offload.cpu_slots={rng.choice([3, 8, 32])}",
        f"offload.policy={rng.choice(['lru', 'arc', 'recall'])}",
        f"offload.shared_pool={rng.choice(['true', 'false'])}",  # a death keeps / drops the tier
        f"engine.max_num_seqs={rng.choice([1, 3, 6])}",
        f"engine.max_num_batched_tokens={rng.choice([8, 16, 48])}",
        f"engine.max_deferred_steps={rng.choice([8, 64])}",
        f"engine.ack_timeout_steps={rng.choice([4, 16])}",
        f"engine.rank_timeout_steps={rng.choice([40, 120])}",
        "faults=[" + ",".join(f'"{f}"' for f in faults) + "]",
    ]
    workload = dict(
        num_requests=rng.randint(8, 30),
        seed=rng.randrange(1 << 16),
        max_tokens=rng.randint(2, 8),
        system_prompts=rng.randint(1, 3),
        system_prompt_tokens=rng.randint(8, 40),
        user_tokens=rng.randint(4, 16),
        answer_tokens=rng.randint(2, 10),
        mean_turns=rng.choice([1.5, 4.0]),
        concurrent_conversations=rng.randint(1, 5),
        arrival_rate=rng.choice([0.0, 0.7, 3.0]),
    )
    max_delay = rng.choice([0, 1, 3])
    return sets, workload, max_delay


def run_episode(sets: list[str], workload: dict, max_delay: int, salt: int) -> int:
    cfg = load_config(None, sets)
    tp = cfg.parallel.tensor_parallel_size
    specs = synthetic_chat(
        workload.pop("num_requests"), vocab_size=cfg.model.vocab_size, **workload
    )
    digests, steps = [], 0
    for offload in (True, False):
        delays = (
            {
                r: (lambda j, r=r: (j * 2654435761 + r * 97 + salt) % (max_delay + 1))
                for r in range(tp)
            }
            if offload
            else None
        )
        with LocalWorkerGroup(cfg, cfg.cpu_slots(), exec_delays=delays, threaded=False) as workers:
            engine = EngineCore(cfg, workers, offload=offload, verify=True)
            report = run_workload(engine, specs, check_invariants=True, max_idle_steps=5000)
            if offload:
                c = engine.connector
                assert len(c.jobs) == 0, f"{len(c.jobs)} jobs left"
                assert not c.fence, f"fence not empty: {sorted(c.fence.blocks())}"
                assert c.tracked() == 0, f"{c.tracked()} request states left"
                d = c.directory.stats()
                assert d.writing == d.reading == 0, "slots still busy"
                checked, bad = workers.verify_cpu_tier(engine.cpu_tier_contents())
                assert bad == 0, f"{bad} of {checked} CPU-tier blocks hold wrong bytes"
                assert report["integrity"]["mismatches"] == 0, "a loaded block mismatched"
                steps = report["steps"]
            assert engine.pool.num_free == engine.pool.num_usable, "GPU blocks leaked"
            digests.append(report["output_digest"])
    assert digests[0] == digests[1], "tokens differ from the run without offloading"
    return steps


def worker(seed: int, first: int, stride: int, quota: int, quiet: bool) -> tuple[int, int, str]:
    """Run episodes first, first + stride, ... until ``quota`` steps: (episodes, steps, error)."""
    start = time.perf_counter()
    total = episodes = 0
    ep = first
    while total < quota:
        rng = random.Random(f"{seed}/{ep}")
        sets, workload, max_delay = episode(rng)
        try:
            total += run_episode(sets, dict(workload), max_delay, ep)
        except Exception:
            return (
                episodes,
                total,
                (
                    f"{traceback.format_exc()}FAIL: seed {seed} episode {ep}\n"
                    f"  sets: {sets}\n  workload: {workload}"
                ),
            )
        episodes += 1
        ep += stride
        if not quiet and episodes % 50 == 0:
            rate = total / (time.perf_counter() - start)
            print(
                f"[{first}] {episodes} episodes, {total:,} steps, {rate:,.0f} steps/s", flush=True
            )
    return episodes, total, ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1_000_000, help="engine steps to run in all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--episode", type=int, help="replay only this episode (from a FAIL line)")
    ap.add_argument("--jobs", type=int, default=1, help="processes running episodes in parallel")
    args = ap.parse_args()
    start = time.perf_counter()
    if args.episode is not None:
        sets, workload, max_delay = episode(random.Random(f"{args.seed}/{args.episode}"))
        steps = run_episode(sets, dict(workload), max_delay, args.episode)
        print(f"ok: episode {args.episode}, {steps} steps")
        return 0
    jobs = max(1, args.jobs)
    quota = -(-args.steps // jobs)
    if jobs == 1:
        results = [worker(args.seed, 0, 1, quota, args.quiet)]
    else:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            results = pool.starmap(
                worker, [(args.seed, k, jobs, quota, args.quiet) for k in range(jobs)]
            )
    episodes = sum(r[0] for r in results)
    total = sum(r[1] for r in results)
    errors = [r[2] for r in results if r[2]]
    for error in errors:
        print(error)
    seconds = time.perf_counter() - start
    verdict = "FAIL" if errors else "ok"
    print(
        f"{verdict}: {episodes} episodes, {total:,} steps checked, {seconds:.0f} s, "
        f"{len(errors)} violations"
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
