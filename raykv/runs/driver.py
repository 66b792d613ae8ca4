"""Drive an engine: requests arrive, steps run, a report sums it up (``raykv run``)."""

from __future__ import annotations

import hashlib
import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from raykv.core.request import Request
from raykv.engine.core import EngineCore
from raykv.engine.stats import snapshot
from raykv.runs.report import RunReport
from raykv.workload.requests import RequestSpec

Progress = Callable[[dict[str, Any]], None]  # called after every step with progress_of()


class RunStalled(RuntimeError):
    """The engine stopped making progress (a bug: every wait in raykv is bounded)."""


Outputs = dict[int, tuple[str, tuple[int, ...]]]  # request index -> (id, generated tokens)


def output_digest(outputs: Outputs) -> str:
    """SHA-256 over every request's generated tokens, in request order."""
    h = hashlib.sha256()
    for index in sorted(outputs):
        _feed(h, *outputs[index])
    return h.hexdigest()


def _feed(h: Any, req_id: str, tokens: Sequence[int]) -> None:
    h.update(f"{req_id}:{','.join(map(str, tokens))};".encode())


class StreamingDigest:
    """``output_digest`` taken in as requests finish, in any order: an output is hashed as soon
    as every earlier request (by index) has finished or been refused, and held until then. So
    what is held is only what finished ahead of an earlier request still running, not every
    output of a long run."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._next = 0  # the lowest index not hashed or skipped yet
        self._ahead: dict[int, tuple[str, tuple[int, ...]]] = {}  # finished, waiting for _next
        self._skipped: set[int] = set()  # refused, above _next

    def add(self, index: int, req_id: str, tokens: Sequence[int]) -> None:
        self._ahead[index] = (req_id, tuple(tokens))
        self._advance()

    def skip(self, index: int) -> None:
        """Request ``index`` will never finish (refused): it is not part of the digest."""
        self._skipped.add(index)
        self._advance()

    def _advance(self) -> None:
        while True:
            if self._next in self._skipped:
                self._skipped.discard(self._next)
            elif self._next in self._ahead:
                _feed(self._hash, *self._ahead.pop(self._next))
            else:
                return
            self._next += 1

    @property
    def held(self) -> int:
        """Outputs held until an earlier request finishes."""
        return len(self._ahead)

    def hexdigest(self) -> str:
        """``output_digest`` of every output added so far (those held included)."""
        h = self._hash.copy()
        for index in sorted(self._ahead):
            _feed(h, *self._ahead[index])
        return h.hexdigest()


class _NoDigest(StreamingDigest):
    """A digest that takes nothing in (a server's): it holds no output."""

    def add(self, index: int, req_id: str, tokens: Sequence[int]) -> None:
        pass

    def skip(self, index: int) -> None:
        pass

    def hexdigest(self) -> str:
        return ""


_MAX_ARRIVAL_WAIT_S = 0.05  # an idle driver sleeps at most this long for a timed arrival
# refusals a server's report keeps (the latest); a batch run keeps every one
REJECTED_KEPT = 1024


class Driver:
    """Feeds requests to an engine as they arrive (one step is one time unit) and steps it.

    Used by ``run_workload`` here and by the scheduler actor's loop on Ray, so both deployments
    drive the engine the same way. A request the engine refuses (too long for the GPU pool, bad
    token ids) is recorded with the reason and the run goes on without it. Finished requests are
    handed over by ``take_finished`` and then forgotten: the output digest takes each output in
    as soon as it can (:class:`StreamingDigest`), so a long run's memory stays flat (with
    ``engine.keep_finished: false``, which lets the engine forget them too).
    """

    def __init__(
        self, engine: EngineCore, *, check_invariants: bool = False, digest: bool = True
    ) -> None:
        """``digest``: keep the output digest (a server does not: its outputs went to their
        clients, and one long request would make it hold every output that finished after)."""
        self.engine = engine
        self.check_invariants = check_invariants
        self.admitted = 0
        self._finished = 0
        self._digest = StreamingDigest() if digest else _NoDigest()
        # refusals for the report: every one, or (an engine that forgets finished requests: a
        # server) the latest REJECTED_KEPT; ``rejected_count`` counts them all
        keep = None if engine.keep_finished else REJECTED_KEPT
        self.rejected: deque[dict[str, str]] = deque(maxlen=keep)
        self.rejected_count = 0
        self._new_rejected: list[dict[str, str]] = []  # since take_rejected
        self._recent: list[Request] = []  # finished since take_finished
        self._pending: list[tuple[float, float, int, RequestSpec]] = []  # (wall, step, index)
        self._origin: float | None = None  # when the first request was submitted
        self._submitted = 0
        self._idle = 0
        self.started = time.perf_counter()

    def submit(self, specs: Iterable[RequestSpec]) -> None:
        if self._origin is None:  # wall-clock arrivals count from the first submission
            self._origin = time.perf_counter()
        for spec in specs:
            wall = spec.arrival_s if spec.arrival_s is not None else 0.0
            heapq.heappush(self._pending, (wall, spec.arrival, self._submitted, spec))
            self._submitted += 1

    @property
    def submitted(self) -> int:
        return self._submitted

    @property
    def finished_count(self) -> int:
        return self._finished

    @property
    def outputs_held(self) -> int:
        """Finished requests' outputs still held (for the digest, until every earlier request
        has finished)."""
        return self._digest.held

    def has_work(self) -> bool:
        return bool(self._pending) or self.engine.has_work()

    def load(self) -> tuple[int, int]:
        """(prompt tokens still to prefill, requests decoding): submitted ones not yet in the
        engine count in full, waiting ones less what the GPU prefix cache holds of them, those
        part-way through their prompt what is left of it (one loading from the CPU tier is
        nearly done and counts nothing). What a router weighs a replica's queue by."""
        scheduler = self.engine.scheduler
        tokens = sum(len(spec.prompt) for *_, spec in self._pending)
        for r in scheduler.waiting:  # what the GPU prefix cache holds of it is not prefilled
            cached = scheduler.kv.local_hit(r)[0] if r.num_computed == 0 else r.num_computed
            tokens += r.num_tokens - cached
        decoding = 0
        for r in scheduler.running:
            if r.num_computed < r.num_prompt:
                tokens += r.num_prompt - r.num_computed
            else:
                decoding += 1
        return tokens, decoding

    def _admit_arrived(self) -> None:
        """Hand the engine what has arrived: by engine steps (``RequestSpec.arrival``) or, for
        a replay at a trace's own timestamps, by wall-clock seconds (``arrival_s``)."""
        engine, pending = self.engine, self._pending
        now = engine.totals.steps
        origin = self._origin if self._origin is not None else time.perf_counter()
        elapsed = time.perf_counter() - origin
        if pending and not engine.has_work():
            wall, step = pending[0][0], pending[0][1]
            now = max(now, step)  # nothing to do: jump to the next arrival
            if wall > elapsed:  # or wait for it, a little at a time (the loop stays live)
                time.sleep(min(wall - elapsed, _MAX_ARRIVAL_WAIT_S))
                elapsed = time.perf_counter() - origin
        while pending and pending[0][1] <= now and pending[0][0] <= elapsed:
            _, _, index, spec = heapq.heappop(pending)
            try:
                req = Request(
                    spec.req_id,
                    index,
                    list(spec.prompt),
                    spec.max_tokens,
                    sampling=spec.sampling,
                    cache_salt=spec.cache_salt,
                )
                if spec.arrival_s is not None:  # it arrived then, whenever the step ended
                    req.arrival_s = origin + spec.arrival_s
                engine.add_request(req)
            except ValueError as exc:  # this request is at fault; the run goes on
                record = {
                    "request": spec.req_id,
                    "error": str(exc),
                    "field": getattr(exc, "field", "prompt"),
                }
                self.rejected.append(record)
                self.rejected_count += 1
                self._new_rejected.append(record)
                self._digest.skip(index)
                continue
            self.admitted += 1

    def step(self, max_idle_steps: int = 100_000) -> list[Request]:
        """Admit what has arrived and run one engine step."""
        self._admit_arrived()
        finished = self.engine.step()
        if self.check_invariants:
            self.engine.check_invariants()
        for req in finished:
            self._digest.add(req.index, req.req_id, req.output)
        self._finished += len(finished)
        self._recent += finished
        self._idle = 0 if finished or self.engine.scheduler.running else self._idle + 1
        if self._idle > max_idle_steps:
            raise RunStalled(
                f"no progress for {self._idle} steps "
                f"({self.finished_count} of {self._submitted} requests finished)"
            )
        return finished

    def take_finished(self) -> list[Request]:
        out, self._recent = self._recent, []
        return out

    def take_rejected(self) -> list[dict[str, str]]:
        """Requests refused since the last call: ``request`` (its id), ``error`` (why) and
        ``field`` (the part of it at fault)."""
        out, self._new_rejected = self._new_rejected, []
        return out

    def abort(self, req_id: str) -> bool:
        """Stop a request (its client went away, or a stop string matched): one not yet handed
        to the engine never is; one in the engine ends now. Either way its output is in no
        digest, and it is not handed over by ``take_finished``. False: no such request runs."""
        for i, (_, _, index, spec) in enumerate(self._pending):
            if spec.req_id == req_id:
                self._pending.pop(i)
                heapq.heapify(self._pending)
                self._digest.skip(index)
                return True
        req = self.engine.requests.get(req_id)
        if req is None or req.finished:
            return False
        self.engine.abort(req_id)
        self._digest.skip(req.index)
        return True

    def report(self) -> RunReport:
        seconds = time.perf_counter() - self.started
        report = RunReport.build(
            snapshot(self.engine),
            self._finished,
            self._digest.hexdigest(),
            self.admitted,
            seconds,
            self.engine.latency,
        )
        report.rejected = list(self.rejected)
        return report


def run_engine(
    engine: EngineCore,
    specs: Sequence[RequestSpec],
    *,
    progress: Progress | None = None,
    check_invariants: bool = False,
    max_idle_steps: int = 100_000,
) -> RunReport:
    """Run ``specs`` to the end: every request finished, every transfer acknowledged."""
    driver = Driver(engine, check_invariants=check_invariants)
    driver.submit(specs)
    while driver.has_work():
        driver.step(max_idle_steps)
        driver.take_finished()
        if progress is not None:
            progress(progress_of(driver))
    return driver.report()


def run_workload(
    engine: EngineCore,
    specs: Sequence[RequestSpec],
    *,
    progress: Progress | None = None,
    check_invariants: bool = False,
    max_idle_steps: int = 100_000,
) -> dict[str, Any]:
    """``run_engine``, with the report in its JSON shape (``RunReport.as_dict``)."""
    return run_engine(
        engine,
        specs,
        progress=progress,
        check_invariants=check_invariants,
        max_idle_steps=max_idle_steps,
    ).as_dict()


def progress_of(driver: Driver) -> dict[str, Any]:
    """A run's progress so far (what the progress bar shows)."""
    e = driver.engine
    s = e.scheduler.stats
    return {
        "finished": driver.finished_count,
        "submitted": driver.submitted,
        "rejected": driver.rejected_count,
        "steps": e.totals.steps,
        "generated_tokens": e.totals.generated_tokens,
        "prompt_tokens": e.totals.prompt_tokens,
        "admitted_tokens": s.admitted_tokens,
        "gpu_hit_tokens": s.gpu_hit_tokens,
        "cpu_hit_tokens": s.cpu_hit_tokens,
        "ttft_p50_s": e.latency.recent_p50(),
    }
