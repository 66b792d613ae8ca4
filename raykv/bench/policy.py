"""``raykv bench policy``: eviction policies against the offline optimum on a request trace.

Each request is replayed through the directory as the connector uses it: look up the prompt's
keys from the first until the first one that is not readable (the prefix hit), touch the hit keys,
then store the prompt's full blocks that are missing (prepare and complete at once).

Two reference rows run on the same accesses: ``belady`` (the offline optimum: on a store, drop
whichever block, cached or new, is next used furthest in the future) and ``baseline_lru`` (the same
LRU semantics written directly on an ``OrderedDict``, the speed yardstick for the directory).
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.table import Table

from raykv.offload import Directory, make_key
from raykv.workload.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

BELADY = "belady"
BASELINE_LRU = "baseline_lru"
REFERENCE_ROWS = (BELADY, BASELINE_LRU)

Progress = Callable[[int], None]


@dataclass(slots=True, frozen=True)
class Access:
    """One request's keys, prepared once so every replay sees identical input."""

    keys: tuple[int, ...]
    full_keys: list[int]
    input_length: int


@dataclass(slots=True)
class ReplayResult:
    policy: str
    capacity_tokens: int
    token_hit_rate: float
    block_hit_rate: float
    evictions: int
    seconds: float

    def as_json(self) -> dict[str, float]:
        return {
            "token_hit_rate": self.token_hit_rate,
            "block_hit_rate": self.block_hit_rate,
            "seconds": self.seconds,
            "evictions": self.evictions,
        }


def prepare_accesses(
    requests: Sequence[TraceRequest], block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[Access]:
    """Turn trace requests into directory keys (one key per hash id, KV group 0)."""
    out = []
    for r in requests:
        keys = tuple(make_key(h) for h in r.hash_ids)
        out.append(Access(keys, list(keys[: r.input_length // block_tokens]), r.input_length))
    return out


class _Tally:
    """Hit accounting shared by every replay."""

    __slots__ = ("block_tokens", "blocks", "hit_blocks", "hit_tokens", "tokens")

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.hit_tokens = self.tokens = self.hit_blocks = self.blocks = 0

    def add(self, access: Access, hit: int) -> None:
        self.hit_tokens += min(hit * self.block_tokens, access.input_length)
        self.tokens += access.input_length
        self.hit_blocks += hit
        self.blocks += len(access.keys)

    def result(
        self, policy: str, capacity_tokens: int, evictions: int, seconds: float
    ) -> ReplayResult:
        return ReplayResult(
            policy,
            capacity_tokens,
            self.hit_tokens / max(self.tokens, 1),
            self.hit_blocks / max(self.blocks, 1),
            evictions,
            seconds,
        )


_TICK = 256  # requests between progress callbacks


def replay_directory(
    accesses: Sequence[Access],
    capacity_tokens: int,
    policy: str,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    progress: Progress | None = None,
) -> ReplayResult:
    """Replay through a real ``Directory`` with the named policy."""
    directory = Directory(max(capacity_tokens // block_tokens, 1), policy, events=False)
    match, touch = directory.match_prefix, directory.touch
    prepare, complete = directory.prepare_store, directory.complete_store
    tally = _Tally(block_tokens)
    start = time.perf_counter()
    for i, access in enumerate(accesses):
        keys = access.keys
        hit, _ = match(keys)  # stores complete at once, so nothing is ever pending here
        if hit:
            touch(keys[:hit])
        tally.add(access, hit)
        plan = prepare(access.full_keys)
        if plan is not None and plan.keys:
            complete(plan.keys)
        if progress is not None and i % _TICK == _TICK - 1:
            progress(_TICK)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress(len(accesses) % _TICK)
    return tally.result(policy, capacity_tokens, directory.stats().evictions, seconds)


def replay_baseline_lru(
    accesses: Sequence[Access],
    capacity_tokens: int,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    progress: Progress | None = None,
) -> ReplayResult:
    """The directory's LRU semantics written directly on one ``OrderedDict``: the least work any
    implementation of this replay can do in Python, so the directory is timed against it."""
    capacity = max(capacity_tokens // block_tokens, 1)
    cache: OrderedDict[int, None] = OrderedDict()
    move = cache.move_to_end
    tally = _Tally(block_tokens)
    evictions = 0
    start = time.perf_counter()
    for i, access in enumerate(accesses):
        keys = access.keys
        hit = 0
        for key in keys:
            if key not in cache:
                break
            hit += 1
        for j in range(hit - 1, -1, -1):
            move(keys[j])
        tally.add(access, hit)
        full = access.full_keys
        new = [k for k in full if k not in cache]
        need = len(cache) + len(new) - capacity
        if need > 0:
            protected = set(full)
            victims = []
            for key in cache:
                if key not in protected:
                    victims.append(key)
                    if len(victims) == need:
                        break
            if len(victims) < need:
                new = []
            else:
                for key in victims:
                    del cache[key]
                evictions += need
        for key in reversed(new):
            cache[key] = None
        if progress is not None and i % _TICK == _TICK - 1:
            progress(_TICK)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress(len(accesses) % _TICK)
    return tally.result(BASELINE_LRU, capacity_tokens, evictions, seconds)


def replay_belady(
    accesses: Sequence[Access],
    capacity_tokens: int,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    progress: Progress | None = None,
) -> ReplayResult:
    """Belady's offline optimum on the same accesses.

    Time is counted in block positions of the flattened trace, so within one request the head is
    "next used" before its tail and the optimum never keeps a tail without its head. A new block
    is stored only if some cached block (not of this request) is next used later than it; that
    block is evicted for it. Blocks never used again are next used at infinity.
    """
    capacity = max(capacity_tokens // block_tokens, 1)
    uses: dict[int, list[int]] = {}
    pos = 0
    for access in accesses:
        for j, key in enumerate(access.keys):
            uses.setdefault(key, []).append(pos + j)
        pos += len(access.keys)
    cursor: dict[int, int] = dict.fromkeys(uses, 0)
    never = pos + 1

    def next_use(key: int, after: int) -> int:
        lst, i = uses[key], cursor[key]
        while i < len(lst) and lst[i] <= after:
            i += 1
        cursor[key] = i
        return lst[i] if i < len(lst) else never

    cached: dict[int, int] = {}  # key -> next use
    heap: list[tuple[int, int]] = []  # (-next use, key), lazily invalidated
    tally = _Tally(block_tokens)
    evictions = 0
    pos = 0
    start = time.perf_counter()
    for i, access in enumerate(accesses):
        keys = access.keys
        hit = 0
        for key in keys:
            if key not in cached:
                break
            hit += 1
        tally.add(access, hit)
        end = pos + len(keys) - 1
        full = access.full_keys
        for key in full:
            if key in cached:
                nu = next_use(key, end)
                cached[key] = nu
                heapq.heappush(heap, (-nu, key))
        protected = set(full)
        for key in full:
            if key in cached:
                continue
            nu = next_use(key, end)
            if len(cached) >= capacity:
                held = []
                victim = None
                while heap:
                    neg, cand = heapq.heappop(heap)
                    if cached.get(cand) != -neg:
                        continue
                    if cand in protected:
                        held.append((neg, cand))
                        continue
                    victim = (neg, cand)
                    break
                for item in held:
                    heapq.heappush(heap, item)
                if victim is None or -victim[0] < nu:
                    if victim is not None:
                        heapq.heappush(heap, victim)
                    continue  # the new block is the one to drop: do not store it
                del cached[victim[1]]
                evictions += 1
            cached[key] = nu
            heapq.heappush(heap, (-nu, key))
        pos += len(keys)
        if progress is not None and i % _TICK == _TICK - 1:
            progress(_TICK)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress(len(accesses) % _TICK)
    return tally.result(BELADY, capacity_tokens, evictions, seconds)


def replay(
    accesses: Sequence[Access],
    capacity_tokens: int,
    policy: str,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    progress: Progress | None = None,
) -> ReplayResult:
    """Replay one row: a directory policy or one of the reference rows."""
    if policy == BELADY:
        return replay_belady(accesses, capacity_tokens, block_tokens, progress)
    if policy == BASELINE_LRU:
        return replay_baseline_lru(accesses, capacity_tokens, block_tokens, progress)
    return replay_directory(accesses, capacity_tokens, policy, block_tokens, progress)


# ---- the command -----------------------------------------------------------------------------


@dataclass(slots=True)
class PolicyBenchReport:
    """Every row of one ``raykv bench policy`` run."""

    trace: str
    requests: int
    block_tokens: int
    repeat: int
    rows: dict[int, dict[str, ReplayResult]]

    def as_json(self) -> dict[str, object]:
        return {
            "trace": self.trace,
            "requests": self.requests,
            "block_tokens": self.block_tokens,
            "repeat": self.repeat,
            "capacities": {
                str(cap): {name: r.as_json() for name, r in row.items()}
                for cap, row in self.rows.items()
            },
        }


def run_policy_bench(
    accesses: Sequence[Access],
    capacities: Sequence[int],
    policies: Sequence[str],
    *,
    trace: str = "",
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    repeat: int = 1,
    progress: Progress | None = None,
) -> PolicyBenchReport:
    """Replay every policy (plus Belady and the bare LRU) at every capacity.

    Hit rates are deterministic; each timed row keeps the fastest of ``repeat`` replays so that
    the speed ratio against the bare LRU is not at the mercy of one noisy run. Belady is the
    reference for hit rates only and replays once.
    """
    rows: dict[int, dict[str, ReplayResult]] = {}
    for cap in capacities:
        row: dict[str, ReplayResult] = {}
        for name in (*policies, BASELINE_LRU, BELADY):
            runs = 1 if name == BELADY else repeat
            best = None
            for _ in range(runs):
                result = replay(accesses, cap, name, block_tokens, progress)
                if best is None or result.seconds < best.seconds:
                    best = result
            assert best is not None
            row[name] = best
        rows[cap] = row
    return PolicyBenchReport(trace, len(accesses), block_tokens, repeat, rows)


def bench_work(n_accesses: int, capacities: int, policies: int, repeat: int) -> int:
    """Total requests a ``run_policy_bench`` call replays (for a progress bar)."""
    return n_accesses * capacities * ((policies + 1) * repeat + 1)


def policy_table(report: PolicyBenchReport) -> Table:
    """One row per (capacity, policy): hit rates, ratio to Belady, speed against the bare LRU."""
    table = Table(
        title=f"raykv bench policy: {report.trace} ({report.requests} requests, "
        f"{report.block_tokens}-token blocks)",
        title_justify="left",
    )
    for col in ("capacity", "policy", "token hit", "x belady", "block hit"):
        table.add_column(col, justify="right" if col != "policy" else "left", no_wrap=True)
    for col in ("evictions", "seconds", "x bare-LRU time"):
        table.add_column(col, justify="right", no_wrap=True)
    for cap, row in report.rows.items():
        best = row[BELADY].token_hit_rate or 1.0
        base = row[BASELINE_LRU].seconds or 1e-9
        for i, (name, r) in enumerate(row.items()):
            table.add_row(
                f"{cap:,} tokens" if i == 0 else "",
                name,
                f"{r.token_hit_rate:.2%}",
                f"{r.token_hit_rate / best:.3f}",
                f"{r.block_hit_rate:.2%}",
                f"{r.evictions:,}",
                f"{r.seconds:.3f}",
                "-" if name == BELADY else f"{r.seconds / base:.2f}",
                end_section=i == len(row) - 1,
            )
    return table
