#!/usr/bin/env python3
"""Fuzz the one-process engine: random configurations, workloads, copy and ack delays, and
faults, with every invariant checked after every step, one step at a time or planned ahead
(async scheduling).

Each episode draws (seeded) 1-4 ranks, one to three KV groups (full attention, sliding windows
of different sizes), tiny GPU pools and CPU tiers that force block reuse, preemption and
eviction, a policy, a store threshold, chunk sizes, per-rank seeded delays for when a copy
really runs and when it is acknowledged (or real copy threads), and a mix of injected faults
(lost, duplicated and late acks, failed copies, dead ranks, whose replacements find their CPU-
pool shard in shared memory or start empty). Four in ten episodes put a disk tier under the CPU
tier (a few chunks to a few hundred, in a directory of their own, removed afterwards), with its
own policy, filter and reserve, its I/O direct or buffered, and its own faults (failed,
corrupted, slow reads and writes; a full disk). One in five puts the shared tier (Mooncake
Store) under them: a master and segment of the fuzzing process's own, joined by every such
episode as replicas join a long-lived store, publishing as chunks reach the CPU tier or as they
leave it, with failed, spoiled and lost parts and a full pool. A disk tier's I/O threads and the
store's run on their own clock, so such an episode, like one with real copy threads, replays
only approximately. One in five episodes loads only the tier hits the measured costs say are
worth it. A hostile client aborts requests at random moments (queued, loading, running), resets
the CPU tier mid-run, and with finished requests forgotten (the serving setting) hands their ids
to new requests. The run with offloading checks the scheduler's books after every step (each
rank checks the fence before every write), then requires the drain (no jobs, no fence, no
request state, no busy slot, every GPU block free), a CPU tier whose every readable chunk holds
the right bytes on every rank, and the tokens of a run without offloading and without the
client's mischief (an aborted request: a prefix of them).

Usage: python scripts/fuzz.py --steps 1000000 [--seed S] [--jobs N] [--async-scheduling on]
(CI runs a short version)
Exit status 1, with the seed and episode to replay, on the first violation.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

from raykv.config import load_config
from raykv.core.arith import cdiv
from raykv.core.request import Request, RequestStatus
from raykv.engine.core import EngineCore
from raykv.engine.stats import drain_books
from raykv.engine.workers import LocalWorkerGroup
from raykv.workload.requests import RequestSpec, synthetic_chat

DISK_PATH = "@DISK@"  # where an episode's disk tier goes: a fresh directory per run
STORE = "@STORE@"  # the shared tier's master: this process's own (``store_address``)
STORE_SEGMENT = 256 << 20
_store: list = []  # this process's master and segment, started by its first shared episode


def store_address() -> str:
    """The master (on loopback) and segment of this process's shared tier, started once (by
    ``main``, before the workers fork: they inherit it) and kept for its life: episodes are
    engines joining a long-lived store, as replicas do. Their
    chunks stay in it between episodes (keys name their bytes: an episode finding another's is
    a real cross-engine hit)."""
    if not _store:
        from raykv.transfer.segment_process import HeldSegment
        from raykv.transfer.shared_master import EmbeddedMaster

        master = EmbeddedMaster()
        address = master.start()
        holder = HeldSegment(address, STORE_SEGMENT)
        holder.start()
        _store.extend([master, holder])
    return _store[0].address


def close_store() -> None:
    """Stop this process's segment and master, if a shared episode started them."""
    while _store:
        _store.pop().stop()  # the segment first, then the master


def shared_available() -> bool:
    from raykv.transfer.shared_store import mooncake_problem

    return mooncake_problem() is None


GROUPS = [
    "[{kind: full_attention}]",
    "[{kind: full_attention}, {kind: sliding_window, window_tokens: 12}]",
    "[{kind: sliding_window, window_tokens: 20}]",
    # two sliding windows of different sizes, alone and beside a full-attention group
    "[{kind: sliding_window, window_tokens: 6}, {kind: sliding_window, window_tokens: 17}]",
    "[{kind: full_attention}, {kind: sliding_window, window_tokens: 5}, "
    "{kind: sliding_window, window_tokens: 14}]",
]


@dataclass(slots=True)
class Chaos:
    """What a hostile client does to the run with offloading (the reference run gets none of
    it): abort requests at random moments (queued, loading or running), reset the CPU tier at
    given steps, and, with finished requests forgotten (``keep_finished: false``, the serving
    setting), give new requests the ids of finished or aborted ones."""

    abort_rate: float = 0.0  # per live request and step
    reset_steps: set[int] = field(default_factory=set)
    reuse_ids: bool = False
    seed: int = 0


def episode(rng: random.Random) -> tuple[list[str], dict, int, Chaos, bool]:
    tp = rng.choice([1, 2, 3, 4])
    groups = rng.choice(GROUPS)
    faults = []
    if rng.random() < 0.5:
        faults.append(f"drop-acks:rate={rng.choice([0.05, 0.2])}:seed={rng.randrange(99)}")
    if rng.random() < 0.5:
        faults.append(f"dup-acks:rate={rng.choice([0.05, 0.3])}:seed={rng.randrange(99)}")
    if rng.random() < 0.3:
        faults.append(f"fail-copy:rate={rng.choice([0.05, 0.2])}:seed={rng.randrange(99)}")
    if rng.random() < 0.2:
        faults.append(f"corrupt-cpu:rate={rng.choice([0.05, 0.3])}:seed={rng.randrange(99)}")
    if rng.random() < 0.3:
        faults.append(f"kill-worker:rate={rng.choice([0.005, 0.02])}:seed={rng.randrange(99)}")
    if rng.random() < 0.3:
        faults.append(f"delay-acks:rank={rng.randrange(tp)}:steps={rng.choice([2, 7])}")
    disk = rng.random() < 0.4
    if disk:
        if rng.random() < 0.3:
            faults.append(f"fail-disk:rate={rng.choice([0.05, 0.3])}:seed={rng.randrange(99)}")
        if rng.random() < 0.3:
            rate = rng.choice([0.05, 0.3])
            faults.append(f"corrupt-disk:rate={rate}:seed={rng.randrange(99)}")
        if rng.random() < 0.2:
            faults.append(f"slow-disk:ms={rng.choice([1, 5])}")
        if rng.random() < 0.2:
            faults.append(f"full-disk:after={rng.choice([0, 5, 40])}")
    # drawn whatever happens, so that episodes replay alike where the store cannot start
    shared = rng.random() < 0.2
    shared_faults = []
    if rng.random() < 0.3:
        shared_faults.append(f"fail-shared:rate={rng.choice([0.05, 0.3])}:seed={rng.randrange(99)}")
    if rng.random() < 0.3:
        kind = rng.choice(["corrupt-shared", "lose-shared"])
        shared_faults.append(f"{kind}:rate={rng.choice([0.1, 0.5])}:seed={rng.randrange(99)}")
    if rng.random() < 0.1:
        shared_faults.append(f"full-shared:after={rng.choice([0, 5, 40])}")
    if shared:
        faults += shared_faults
    keep_finished = rng.random() < 0.5
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
        f"offload.store_threshold={rng.choice([0, 0, 2, 3])}",
        f"offload.shared_pool={rng.choice(['true', 'false'])}",  # a death keeps / drops the tier
        # a loaded request computes in its load's step, or in the step after the load's acks
        f"offload.load_in_step={rng.choice(['true', 'false'])}",
        f"engine.schedule_policy={rng.choice(['fcfs', 'shortest-prefill'])}",
        f"engine.max_bypass_steps={rng.choice([1, 4, 16])}",
        f"engine.short_prefill_alone={rng.choice([0, 16, 64])}",
        # plan each step before the one before has answered (the reference run never does)
        f"engine.async_scheduling={rng.choice(['true', 'false'])}",
        f"engine.max_num_seqs={rng.choice([1, 3, 6])}",
        f"engine.max_num_batched_tokens={rng.choice([8, 16, 48])}",
        f"engine.max_wait_s={rng.choice([0.01, 5.0])}",
        f"engine.ack_timeout_steps={rng.choice([4, 16])}",
        f"engine.rank_timeout_steps={rng.choice([40, 120])}",
        f"engine.keep_finished={'true' if keep_finished else 'false'}",
        f"offload.take_hits={'faster' if rng.random() < 0.2 else 'always'}",
        "faults=[" + ",".join(f'"{f}"' for f in faults) + "]",
    ]
    if disk:
        sets += [
            "offload.disk.enabled=true",
            f"offload.disk.path={DISK_PATH}",
            f"offload.disk.capacity={rng.choice(['64KiB', '1MiB', '8MiB'])}",
            f"offload.disk.policy={rng.choice(['lru', 'arc', 'recall'])}",
            f"offload.disk.store_threshold={rng.choice([0, 0, 2])}",
            f"offload.disk.reserve_fraction={rng.choice([0.125, 0.5])}",
            f"offload.disk.io_threads={rng.choice([1, 2])}",
            f"offload.disk.direct_io={rng.choice(['auto', 'off'])}",
        ]
    if shared:
        sets += [
            "offload.shared.enabled=true",
            f"offload.shared.master={STORE}",
            "offload.shared.mount=false",  # this process's segment (``store_address``)
            f"offload.shared.segment={STORE_SEGMENT}",
            f"offload.shared.retry_steps={rng.choice([8, 64])}",
            f"offload.shared.publish={rng.choice(['through', 'back'])}",
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
    chaos = Chaos(
        abort_rate=rng.choice([0.0, 0.0, 0.01, 0.05]),
        reset_steps={rng.randrange(200) for _ in range(rng.choice([0, 0, 1, 3]))},
        reuse_ids=not keep_finished and rng.random() < 0.7,
        seed=rng.randrange(1 << 16),
    )
    # real copy threads: timing decides the interleaving, so such an episode replays only
    # approximately; every check still holds
    threaded = rng.random() < 0.15
    return sets, workload, max_delay, chaos, threaded


def drive(
    engine: EngineCore, specs: list[RequestSpec], chaos: Chaos
) -> tuple[dict[int, tuple[int, ...]], set[int], list[Request]]:
    """Run ``specs`` to the end under ``chaos``, checking the invariants after every step.
    Returns each request's generated tokens by index, the indices aborted, and every request
    the engine took (it may have forgotten them: their hash chains name the CPU tier's
    chunks)."""
    rng = random.Random(chaos.seed)
    pending = sorted(range(len(specs)), key=lambda i: (specs[i].arrival, i))
    live: dict[int, Request] = {}
    seen: list[Request] = []
    outputs: dict[int, tuple[int, ...]] = {}
    aborted: set[int] = set()
    free_ids: list[str] = []  # ids of requests that are gone (finished or aborted)
    idle = 0
    while pending or engine.has_work():
        now = engine.totals.steps
        if pending and not engine.has_work():
            now = max(now, specs[pending[0]].arrival)
        while pending and specs[pending[0]].arrival <= now:
            index = pending.pop(0)
            spec = specs[index]
            req_id = spec.req_id
            if chaos.reuse_ids and free_ids and rng.random() < 0.5:
                req_id = free_ids.pop(rng.randrange(len(free_ids)))
            req = Request(req_id, index, list(spec.prompt), spec.max_tokens)
            try:
                engine.add_request(req)
            except ValueError:
                continue  # refused in the reference run too (too long, bad token)
            live[index] = req
            seen.append(req)
        if chaos.abort_rate:
            for index, req in list(live.items()):
                # a load is in flight for a few steps only: aim at it more often
                loading = req.status is RequestStatus.WAITING_FOR_LOAD
                if rng.random() < chaos.abort_rate * (10 if loading else 1):
                    engine.abort(req.req_id)
                    outputs[index] = tuple(req.output)
                    aborted.add(index)
                    free_ids.append(req.req_id)
                    del live[index]
        if engine.totals.steps in chaos.reset_steps:
            engine.reset_offload()
        finished = engine.step()
        engine.check_invariants()
        for req in finished:
            outputs[req.index] = tuple(req.output)
            free_ids.append(req.req_id)
            live.pop(req.index, None)
        idle = 0 if finished or engine.scheduler.running else idle + 1
        assert idle <= 5000, f"no progress for {idle} steps"
    return outputs, aborted, seen


def check_drained(engine: EngineCore, workers: LocalWorkerGroup, seen: list[Request]) -> None:
    """DESIGN's drain and integrity after a run with offloading: no jobs, no fence, no request
    state, no busy slot, nothing loading, every GPU block free, no loaded block mismatched, and
    every readable chunk of the CPU tier holding the right bytes on every rank."""
    c = engine.connector
    assert c is not None
    books = drain_books(engine)
    assert books and not any(books.values()), f"not drained: {books}"
    # late reports may still be on their way only for jobs a reset or a death abandoned
    late = [j for w in workers.workers for j in w.held_jobs() if j >= c.jobs.stale_below]
    assert not late, f"reports of live jobs {late} still held by a rank"
    # chunks corrupt-cpu spoiled stay in the tier until a load checks them: then only what the
    # model read (mismatches, below) must be right
    if not any(f.startswith("corrupt-cpu") for f in engine.cfg.faults):
        checked, bad = workers.verify_cpu_tier(engine.cpu_tier_contents(seen))
        assert bad == 0, f"{bad} of {checked} CPU-tier blocks hold wrong bytes"
    assert engine.totals.transfer.mismatches == 0, "a loaded block mismatched"


def compare(outputs: dict, aborted: set[int], reference: dict) -> None:
    """Every request not aborted has the reference's tokens; an aborted one a prefix of them."""
    assert set(outputs) == set(reference), "a different set of requests was refused"
    for index, tokens in outputs.items():
        if index in aborted:
            assert reference[index][: len(tokens)] == tokens, f"aborted request {index} diverged"
        else:
            assert tokens == reference[index], f"request {index}: tokens differ from no-offload"


def reference_outputs(sets: list[str], specs: list[RequestSpec]) -> dict:
    """The tokens of a run without offloading, without chaos, one step at a time."""
    cfg = load_config(None, [*sets, "engine.async_scheduling=false"])
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        engine = EngineCore(cfg, workers, offload=False)
        reference, _, _ = drive(engine, specs, Chaos())
        assert engine.pool.num_free == engine.pool.num_usable, "GPU blocks leaked (no offload)"
    return reference


def run_episode(
    sets: list[str], workload: dict, max_delay: int, salt: int, chaos: Chaos, threaded: bool
) -> int:
    """The episode with offloading under ``chaos``, checked against the reference (a disk tier
    in a fresh directory, removed afterwards)."""
    if any(STORE in s for s in sets):
        if not shared_available():  # the episode without its shared tier
            sets = [s for s in sets if not s.startswith("offload.shared.")]
        else:
            sets = [s.replace(STORE, store_address()) for s in sets]
    with tempfile.TemporaryDirectory(prefix="raykv-fuzz-disk-") as disk:
        placed = [s.replace(DISK_PATH, disk) for s in sets]
        return _run_episode(placed, workload, max_delay, salt, chaos, threaded)


def _run_episode(
    sets: list[str], workload: dict, max_delay: int, salt: int, chaos: Chaos, threaded: bool
) -> int:
    cfg = load_config(None, sets)
    tp = cfg.parallel.tensor_parallel_size
    specs = synthetic_chat(
        workload.pop("num_requests"), vocab_size=cfg.model.vocab_size, **workload
    )
    delays = {
        r: (lambda j, r=r: (j * 2654435761 + r * 97 + salt) % (max_delay + 1)) for r in range(tp)
    }
    with LocalWorkerGroup(
        cfg, cfg.cpu_slots(), exec_delays=None if threaded else delays, threaded=threaded
    ) as workers:
        engine = EngineCore(cfg, workers, verify=True)
        outputs, aborted, seen = drive(engine, specs, chaos)
        check_drained(engine, workers, seen)
        steps = engine.totals.steps
    compare(outputs, aborted, reference_outputs(sets, specs))
    return steps


def force_async(sets: list[str], mode: str) -> list[str]:
    """The episode's settings with async scheduling as ``mode`` says (``mixed``: as drawn)."""
    if mode == "mixed":
        return sets
    key = "engine.async_scheduling="
    return [f"{key}{'true' if mode == 'on' else 'false'}" if s.startswith(key) else s for s in sets]


def worker(
    seed: int, first: int, stride: int, quota: int, quiet: bool, mode: str = "mixed"
) -> tuple[int, int, str]:
    """Run episodes first, first + stride, ... until ``quota`` steps: (episodes, steps, error)."""
    start = time.perf_counter()
    total = episodes = 0
    ep = first
    while total < quota:
        rng = random.Random(f"{seed}/{ep}")
        sets, workload, max_delay, chaos, threaded = episode(rng)
        sets = force_async(sets, mode)
        try:
            total += run_episode(sets, dict(workload), max_delay, ep, chaos, threaded)
        except Exception:
            return (
                episodes,
                total,
                (
                    f"{traceback.format_exc()}FAIL: seed {seed} episode {ep}\n"
                    f"  sets: {sets}\n  workload: {workload}\n  chaos: {chaos}, "
                    f"threaded: {threaded}"
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
    ap.add_argument(
        "--async-scheduling",
        choices=["mixed", "on", "off"],
        default="mixed",
        help="plan steps ahead in every episode (on), none (off), or as each episode draws",
    )
    args = ap.parse_args()
    start = time.perf_counter()
    if args.episode is not None:
        sets, workload, max_delay, chaos, threaded = episode(
            random.Random(f"{args.seed}/{args.episode}")
        )
        sets = force_async(sets, args.async_scheduling)
        steps = run_episode(sets, dict(workload), max_delay, args.episode, chaos, threaded)
        print(f"ok: episode {args.episode}, {steps} steps")
        return 0
    jobs = max(1, args.jobs)
    quota = cdiv(args.steps, jobs)
    if shared_available():  # started here: a pool's workers may not start processes
        store_address()
    if jobs == 1:
        results = [worker(args.seed, 0, 1, quota, args.quiet, args.async_scheduling)]
    else:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            results = pool.starmap(
                worker,
                [
                    (args.seed, k, jobs, quota, args.quiet, args.async_scheduling)
                    for k in range(jobs)
                ],
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
    # ended by a signal, the store is still stopped (its log removed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        status = main()
    finally:
        close_store()
    sys.exit(status)
