"""Latency as a client sees it: time to first token and inter-token latency, in wall seconds.

A request *arrives* when it is handed to the engine (``EngineCore.add_request``): the driver
hands over each request once its arrival (a trace's scaled timestamp or the workload's step)
has come, so TTFT counts the time a request queued for a batch slot, waited for a load and
computed its prefill. A token *is out* when the step that sampled it has returned. TTFT is
first token minus arrival; every later token adds one inter-token latency (ITL) sample, the
time since the request's previous token (a recomputation after a preemption or a rank restart
shows up there, as a client would see it).
"""

from __future__ import annotations

import math
import random
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from raykv.core.request import Request


@dataclass(slots=True)
class RequestLatency:
    """One request's first token, as the per-request list of the run report holds it."""

    req_id: str
    arrival_s: float  # from the start of the run
    ttft_s: float
    prompt_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    disk_hit_tokens: int = 0
    shared_hit_tokens: int = 0
    # where its TTFT went: waiting for a seat (arrival to admission), waiting for its tier hit
    # to land (admission to the load's last ack; 0 without one), computing (the rest)
    queued_s: float = 0.0
    load_s: float = 0.0
    compute_s: float = 0.0
    # what the scheduler predicted when it took or passed over a tier hit: seconds from there
    # to the first token with what it chose, and by recomputing (None: no tier hit in reach)
    predicted_s: float | None = None
    predicted_recompute_s: float | None = None


@dataclass(slots=True)
class LatencySummary:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencySummary | None:
        """None for no values (a run in which nothing sampled)."""
        if not values:
            return None
        ordered = sorted(values)
        return cls.of_sorted(ordered, sum(ordered) / len(ordered))

    @classmethod
    def of_sorted(cls, ordered: Sequence[float], mean: float) -> LatencySummary:
        """Percentiles of sorted values beside a mean known apart (that of more values than
        were kept, for a sample)."""
        return cls(mean, percentile(ordered, 50), percentile(ordered, 90), percentile(ordered, 99))


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of sorted values, interpolated linearly between ranks."""
    if len(ordered) == 1:
        return ordered[0]
    at = (len(ordered) - 1) * q / 100.0
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


class Samples:
    """A stream of values in bounded memory: their exact count and sum (the mean), and for the
    percentiles a uniform sample of at most ``capacity`` of them (reservoir sampling): every
    value while there are no more than ``capacity``, so a run of that size reports its exact
    percentiles, and a server running for days holds ``capacity`` floats, not one per token."""

    __slots__ = ("_random", "capacity", "count", "kept", "total")

    def __init__(self, capacity: int, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"a sample of {capacity} values holds nothing")
        self.capacity = capacity
        self.count = 0
        self.total = 0.0
        self.kept = array("d")
        self._random = random.Random(seed)  # seeded: a rerun keeps the same sample

    def add(self, value: float) -> None:
        """Count ``value`` (and keep it, or by chance in place of a kept one)."""
        self.count += 1
        self.total += value
        if len(self.kept) < self.capacity:
            self.kept.append(value)
            return
        # the n-th value replaces a kept one with probability capacity / n: every value seen
        # stays in the sample with the same probability
        slot = self._random.randrange(self.count)
        if slot < self.capacity:
            self.kept[slot] = value

    def __len__(self) -> int:
        """How many values were added (not how many are kept)."""
        return self.count

    def summary(self) -> LatencySummary | None:
        """Mean (exact) and percentiles (of the sample); None for no values."""
        if not self.count:
            return None
        return LatencySummary.of_sorted(sorted(self.kept), self.total / self.count)


# TTFT and ITL values a book keeps for percentiles unless the config says otherwise
DEFAULT_SAMPLES = 65536
# first-token records an engine that forgets finished requests (a server) keeps: the latest
RECENT_REQUESTS = 1024
# TTFTs the progress bar's median covers
RECENT_TTFT = 512


@dataclass(slots=True)
class LatencyBook:
    """One engine's TTFT and ITL, in bounded memory (``Samples``), and each request's
    first-token record: every one for a batch run's report, the latest ``max_records`` where
    set (a server)."""

    clock: Callable[[], float] = time.perf_counter
    started: float = field(default=0.0)
    samples: int = DEFAULT_SAMPLES
    max_records: int | None = None
    ttft: Samples = field(init=False)
    itl: Samples = field(init=False)
    requests: deque[RequestLatency] = field(init=False)
    export: bool = False  # keep new samples for ``take_new`` (a metrics exporter reads them)
    _recent_ttft: deque[float] = field(init=False)
    # what ``take_new`` has not handed out yet
    _new_ttft: list[float] = field(default_factory=list)
    _new_itl: list[float] = field(default_factory=list)
    # per tier: requests with a hit from it whose first token came later (from admission) than
    # the scheduler's own prediction of recomputing them
    later_than_recompute: dict[str, int] = field(
        default_factory=lambda: {"cpu": 0, "disk": 0, "shared": 0}
    )

    def __post_init__(self) -> None:
        self.started = self.clock()
        self.ttft = Samples(self.samples, seed=1)
        self.itl = Samples(self.samples, seed=2)
        self.requests = deque(maxlen=self.max_records)
        self._recent_ttft = deque(maxlen=RECENT_TTFT)

    def arrived(self, req: Request) -> None:
        """``req`` reached the engine now, unless its driver said when it arrived."""
        if req.arrival_s is None:
            req.arrival_s = self.clock()

    def sampled(self, req: Request, now: float) -> None:
        """``req`` got a token from the step that returned at ``now``."""
        if req.arrival_s is None:
            return
        if req.last_token_s is None:
            ttft = now - req.arrival_s
            self.ttft.add(ttft)
            self._recent_ttft.append(ttft)
            if self.export:
                self._new_ttft.append(ttft)
            self.requests.append(self._first_token(req, ttft, now))
        else:
            gap = now - req.last_token_s
            self.itl.add(gap)
            if self.export:
                self._new_itl.append(gap)
        req.last_token_s = now

    def _first_token(self, req: Request, ttft: float, now: float) -> RequestLatency:
        """``req``'s record; a tier hit whose first token came later than the scheduler
        predicted recomputing would have taken counts in ``later_than_recompute``."""
        arrival = req.arrival_s if req.arrival_s is not None else now
        admitted = req.admitted_s if req.admitted_s is not None else arrival
        loaded = req.loaded_s if req.loaded_s is not None else admitted
        recompute = req.predicted_recompute_s
        tier = (
            "shared"
            if req.num_shared_hit_tokens
            else "disk"
            if req.num_disk_hit_tokens
            else "cpu"
            if req.num_cpu_hit_tokens
            else None
        )
        if tier is not None and recompute is not None and now - admitted > recompute:
            self.later_than_recompute[tier] += 1
        return RequestLatency(
            req.req_id,
            arrival - self.started,
            ttft,
            req.num_prompt,
            req.num_gpu_hit_tokens,
            req.num_cpu_hit_tokens,
            req.num_disk_hit_tokens,
            req.num_shared_hit_tokens,
            max(0.0, admitted - arrival),
            max(0.0, loaded - admitted),
            max(0.0, now - loaded),
            req.predicted_s,
            recompute,
        )

    def recent_p50(self) -> float | None:
        """The median TTFT of the latest ``RECENT_TTFT`` requests (what a progress bar shows;
        cheap at any run length)."""
        recent = self._recent_ttft
        return percentile(sorted(recent), 50) if recent else None

    def record_of(self, req_id: str) -> RequestLatency | None:
        """``req_id``'s first-token record, the latest one under that id (None: not kept)."""
        return next((r for r in reversed(self.requests) if r.req_id == req_id), None)

    def take_new(self) -> tuple[list[float], list[float]]:
        """TTFT and ITL samples since the last call."""
        out = self._new_ttft, self._new_itl
        self._new_ttft, self._new_itl = [], []
        return out

    def report(self) -> dict[str, Any]:
        """``ttft_s`` and ``itl_s`` summaries and the per-request list, in the report's shape."""
        ttft, itl = self.ttft.summary(), self.itl.summary()
        return {
            "ttft_s": asdict(ttft) if ttft else None,
            "itl_s": asdict(itl) if itl else None,
            "requests": [asdict(r) for r in self.requests],
        }
