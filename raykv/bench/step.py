"""``raykv bench step``: does the connector's per-step bookkeeping grow with what is cached?

A steady-state engine step changes a fixed, small amount of state: a few running requests each
compute one more block (one ``on_allocated`` each, one store job each in ``plan``), one waiting
request is looked up, every other one of them loads a cached prefix (its ``on_allocated`` brings
the load), the workers' acks for the previous step's jobs come back (``process_reports``) and
requests that computed their last block end (``request_finished``). This bench drives exactly
that scheduler-side connector work against a CPU tier pre-filled with C chunks and a GPU pool of
C + a margin blocks, and times only the connector's calls. The change per step is identical for
every C (the workload is a deterministic function of the step number; ``same_work`` in the
result checks it), so the cost per step should not depend on C.

What is deliberately not scaled with C: the connector's tracked requests. The engine tracks a
request only until its last job is final, so the tracked set is bounded by the requests in flight
(here ``REQUEST_BLOCKS + 1``), never by the size of the CPU tier.

The CPU tier is full in steady state (capacity C + ``HEADROOM``, filled during the untimed warmup),
so every stored chunk evicts one: eviction is part of the per-step change, as on a real server.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from raykv.connector.scheduled import ScheduledRequest
from raykv.connector.scheduler import ConnectorScheduler
from raykv.core.block_pool import BlockPool
from raykv.core.hashing import block_hashes
from raykv.core.keys import make_key
from raykv.core.kv_groups import GroupKind, KVGroup
from raykv.core.request import Request
from raykv.core.step import StepReport, TransferReport
from raykv.offload.directory import Directory

BLOCK_SIZE = 16
NUM_RANKS = 2
HOT_DOCS = 4  # cached documents the hitting requests cycle through
HOT_CHUNKS = 4  # chunks of a hot document a hitting request loads
REQUEST_BLOCKS = 4  # blocks every request computes (one per step) before it finishes
HEADROOM = 16  # CPU slots beyond the C pre-filled chunks
GPU_MARGIN = 256  # GPU blocks beyond C: enough for every request in flight
DEFAULT_LIMIT = 1.2  # the project's bound on cost(max cached) / cost(min cached)
# below this a hot document can be evicted between two of its hits (8 steps apart, with ~4 new
# chunks stored per step), and the per-step work would then depend on C
MIN_CACHED = 64
_SEED = 20240611
_STRETCH = 25  # timed steps of one cached count before the next count's turn


@dataclass(slots=True)
class _Live:
    """A request the bench drives: its blocks, and how many it still has to compute."""

    req: Request
    blocks: list[int]
    left: int
    load_tokens: int = 0


@dataclass(slots=True)
class _Work:
    """What the bench itself counts (the connector and the directory count the rest)."""

    hit_tokens: int = 0
    flushes: int = 0
    acks: int = 0
    finished: int = 0
    max_tracked: int = 0


class _StepSim:
    """One steady-state engine, reduced to what the connector's scheduler half sees."""

    def __init__(self, cached: int, policy: str, seed: int = _SEED) -> None:
        self.cached = cached
        self.directory = Directory(cached + HEADROOM, policy, events=False)
        self.connector = ConnectorScheduler(
            self.directory,
            [KVGroup(0, GroupKind.FULL_ATTENTION)],
            block_size=BLOCK_SIZE,
            blocks_per_chunk=1,
            num_ranks=NUM_RANKS,
        )
        # GPU block ids come from a pool sized like the cache. Lookups pass num_local=0: the
        # requests' prefixes are modelled as gone from the GPU cache (else a large pool would
        # turn the CPU hits into GPU hits and the work would depend on C)
        self.pool = BlockPool(cached + GPU_MARGIN)
        self._docs = [self._doc_tokens(d) for d in range(HOT_DOCS)]
        self._prefill(random.Random(seed))
        self._running: list[_Live] = []
        self._loading: dict[Request, _Live] = {}
        self._retry: list[Request] = []
        self._reports: list[StepReport] = []
        self._serial = 0
        self._step = 0
        self.work = _Work()

    @staticmethod
    def _doc_tokens(doc: int) -> list[int]:
        base = (1 << 40) + doc * HOT_CHUNKS * BLOCK_SIZE
        return list(range(base, base + HOT_CHUNKS * BLOCK_SIZE))

    def _prefill(self, rng: random.Random) -> None:
        hot = [make_key(h) for doc in self._docs for h in block_hashes(doc, BLOCK_SIZE)]
        cold: set[int] = set()
        while len(cold) < self.cached - len(hot):
            cold.add(make_key(rng.getrandbits(64)))
        d = self.directory
        # cold first, hot second: the hot documents start as the most recently used
        for keys in (list(cold - set(hot)), hot):
            plan = d.prepare_store(keys)
            assert plan is not None and len(plan.keys) == len(keys)
            d.complete_store(plan.keys)

    def _arrival(self) -> Request:
        """The step's new request: every other one starts with a hot document (a CPU hit of
        ``HOT_CHUNKS`` chunks), the rest are all new. Hashed here: that is engine work."""
        n = self._serial
        self._serial += 1
        base = n * REQUEST_BLOCKS * BLOCK_SIZE
        prompt = list(range(base, base + REQUEST_BLOCKS * BLOCK_SIZE))
        if n % 2 == 0:
            prompt = self._docs[(n // 2) % HOT_DOCS] + prompt
        req = Request(f"r{n}", n, prompt, max_tokens=1)
        req.update_hashes(BLOCK_SIZE)
        return req

    def step(self) -> int:
        """Run one engine step; returns the nanoseconds spent inside the connector."""
        conn, pool = self.connector, self.pool
        waiting = [*self._retry, self._arrival()]
        self._retry = []
        # ---- admission: lookups (timed), then the engine allocates (not timed)
        t0 = time.perf_counter_ns()
        hits = [conn.lookup(req, 0) for req in waiting]
        spent = time.perf_counter_ns() - t0
        computing = list(self._running)
        loads: list[_Live] = []
        for req, hit in zip(waiting, hits, strict=True):
            if hit is None:
                self._retry.append(req)
            elif hit > 0:
                live = _Live(req, pool.allocate(hit // BLOCK_SIZE), REQUEST_BLOCKS, hit)
                loads.append(live)
                self.work.hit_tokens += hit
            else:
                computing.append(_Live(req, [], REQUEST_BLOCKS))
        new_blocks = [pool.allocate(1) for _ in computing]
        for live, blocks in zip(computing, new_blocks, strict=True):
            live.blocks += blocks
        scheduled = [ScheduledRequest(live.req, BLOCK_SIZE) for live in computing]
        ending = [live.req for live in computing if live.left == 1]
        # ---- the connector's share of the step (timed); the acks answer the previous step's
        # jobs: they are plain data built by the workers, so fakes stand in for them here
        t0 = time.perf_counter_ns()
        for live in loads:
            conn.on_allocated(live.req, (live.blocks,), live.blocks, live.load_tokens)
        for live, blocks in zip(computing, new_blocks, strict=True):
            conn.on_allocated(live.req, (blocks,), blocks)
        plan = conn.plan(self._step, scheduled, ())
        done = conn.process_reports(self._reports)
        for req in ending:
            conn.request_finished(req)
        spent += time.perf_counter_ns() - t0
        # ---- the engine's own bookkeeping after the step (not timed)
        job_ids = [s.job_id for s in plan.loads] + [s.job_id for s in plan.stores]
        self._reports = [
            StepReport(rank, self._step, TransferReport(list(job_ids))) for rank in range(NUM_RANKS)
        ]
        self._account(plan.flush, len(ending), len(job_ids))
        running: list[_Live] = []
        for live in computing:
            live.req.num_computed += BLOCK_SIZE
            live.left -= 1
            if live.left:
                running.append(live)
            else:
                pool.free(reversed(live.blocks))
        for live in loads:
            self._loading[live.req] = live
        for load in done:  # landed loads: their requests compute from the next step on
            live = self._loading.pop(load.req)
            assert load.ok
            live.req.num_computed += live.load_tokens
            running.append(live)
        self._running = running
        self._step += 1
        return spent

    def _account(self, flush: Sequence[int], finished: int, jobs: int) -> None:
        w = self.work
        w.flushes += len(flush)
        w.finished += finished
        w.acks += jobs * NUM_RANKS
        w.max_tracked = max(w.max_tracked, self.connector.tracked())

    def snapshot(self) -> dict[str, int]:
        """The cumulative work counters (connector, directory and the bench's own)."""
        s, d = self.connector.stats, self.directory.stats()
        w = self.work
        return {
            "lookups": s.lookups,
            "deferred_lookups": s.deferred_lookups,
            "hit_tokens": w.hit_tokens,
            "load_jobs": s.load_jobs,
            "load_blocks": s.load_blocks,
            "store_jobs": s.store_jobs,
            "store_blocks": s.store_blocks,
            "flushes": w.flushes,
            "acks": w.acks,
            "finished": w.finished,
            "dir_hits": d.hits,
            "dir_loads": d.loads,
            "dir_stored": d.keys_stored,
            "dir_evictions": d.evictions,
        }


def run_step_bench(
    cached: Sequence[int] = (100, 10_000),
    steps: int = 2000,
    repeat: int = 3,
    policy: str = "lru",
    warmup: int = 200,
    check: bool = False,
) -> dict[str, object]:
    """Time the connector's scheduler-side work per engine step for each cached count.

    Each repeat runs ``steps`` timed steps on every cached count, interleaved in short stretches
    so the machine's drift hits all counts alike; per count the best median and the best mean
    over the repeats are kept. ``check`` verifies the connector's and the directory's
    invariants after every step (slow; for tests).

    Returns ``{"policy", "steps", "repeat", "warmup", "per_step", "cached": {"<C>": {"us_per_step",
    "median_us", "mean_us", "resident", "capacity", "max_tracked", "work"}}, "ratio",
    "mean_ratio", "limit", "within_limit", "same_work"}``; ``ratio`` is the median cost at the
    largest C over the one at the smallest, and ``work`` holds per-step averages of the counters
    that ``same_work`` compares across C.
    """
    counts = sorted(set(cached))
    if not counts:
        raise ValueError("cached: give at least one count")
    if counts[0] < MIN_CACHED:
        raise ValueError(f"cached counts must be >= {MIN_CACHED}, got {counts[0]}")
    if steps < 1 or repeat < 1 or warmup < 0:
        raise ValueError(
            f"need steps >= 1, repeat >= 1, warmup >= 0 (got {steps}, {repeat}, {warmup})"
        )
    sims = {c: _StepSim(c, policy) for c in counts}
    for sim in sims.values():
        for _ in range(warmup):
            sim.step()
    before = {c: sim.snapshot() for c, sim in sims.items()}
    best_median = dict.fromkeys(counts, float("inf"))
    best_mean = dict.fromkeys(counts, float("inf"))
    gc_was_enabled = gc.isenabled()
    try:
        for _ in range(repeat):
            times: dict[int, list[int]] = {c: [] for c in counts}
            # a collection would land on whichever step happened to allocate the most; it is the
            # interpreter's cost, not the connector's, so it runs between rounds instead
            gc.collect()
            gc.disable()
            # short stretches of each count in turn: this machine's speed drifts by tens of
            # percent within a second, and fine interleaving exposes every count to the same drift
            for lo in range(0, steps, _STRETCH):
                n = min(_STRETCH, steps - lo)
                for c in counts:
                    sim, out = sims[c], times[c]
                    for _ in range(n):
                        out.append(sim.step())
                        if check:
                            sim.connector.check_invariants()
                            sim.directory.check_invariants()
            if gc_was_enabled:
                gc.enable()
            for c in counts:
                best_median[c] = min(best_median[c], statistics.median(times[c]) / 1e3)
                best_mean[c] = min(best_mean[c], statistics.fmean(times[c]) / 1e3)
    finally:
        if gc_was_enabled:
            gc.enable()
    timed_steps = steps * repeat
    per_c: dict[str, dict[str, object]] = {}
    work_of: dict[int, dict[str, int]] = {}
    for c, sim in sims.items():
        after = sim.snapshot()
        work_of[c] = {k: after[k] - before[c][k] for k in after}
        per_c[str(c)] = {
            "us_per_step": best_median[c],
            "median_us": best_median[c],
            "mean_us": best_mean[c],
            "resident": len(sim.directory),
            "capacity": sim.directory.capacity,
            "max_tracked": sim.work.max_tracked,
            "work": {k: v / timed_steps for k, v in work_of[c].items()},
        }
    lo, hi = counts[0], counts[-1]
    ratio = best_median[hi] / best_median[lo]
    return {
        "policy": policy,
        "steps": steps,
        "repeat": repeat,
        "warmup": warmup,
        "per_step": {
            "arrivals": 1,
            "hit_chunks_every_other_arrival": HOT_CHUNKS,
            "blocks_per_request": REQUEST_BLOCKS,
            "block_size": BLOCK_SIZE,
            "ranks": NUM_RANKS,
        },
        "cached": per_c,
        "ratio": ratio,
        "mean_ratio": best_mean[hi] / best_mean[lo],
        "limit": DEFAULT_LIMIT,
        "within_limit": ratio <= DEFAULT_LIMIT,
        "same_work": all(w == work_of[lo] for w in work_of.values()),
    }


def format_step_table(result: dict[str, object]) -> str:
    """The bench result as a plain-text table, with the verdict on the last line."""
    per_c = result["cached"]
    assert isinstance(per_c, dict)
    lines = [
        f"connector step bench ({result['policy']} policy, {result['steps']} steps, "
        f"best of {result['repeat']})",
        f"{'cached':>8} {'resident':>9} {'median us':>10} {'mean us':>9} {'stores':>7} "
        f"{'loads':>6} {'tracked':>8}",
    ]
    for c, row in per_c.items():
        work = row["work"]
        lines.append(
            f"{c:>8} {row['resident']:>9} {row['median_us']:>10.2f} {row['mean_us']:>9.2f} "
            f"{work['store_blocks']:>7.2f} {work['load_blocks']:>6.2f} {row['max_tracked']:>8}"
        )
    verdict = "ok" if result["within_limit"] else "OVER LIMIT"
    same = "identical" if result["same_work"] else "DIFFERENT (comparison invalid)"
    lines.append(
        f"ratio {result['ratio']:.3f} (mean {result['mean_ratio']:.3f}), limit "
        f"{result['limit']}: {verdict}; work per step across counts: {same}"
    )
    return "\n".join(lines)
