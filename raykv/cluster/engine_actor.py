"""The engine actor: ``EngineServer``, the scheduler.

It wraps the one-process engine's objects unchanged: an ``EngineCore`` (engine, connector
scheduler half, directory) whose worker group fans each step's plan out to the rank actors and
gathers the replies: through a Ray Compiled Graph (:mod:`raykv.cluster.compiled_group`, by
default for CUDA ranks) or one call per rank per step
(:class:`raykv.cluster.worker_group.RayWorkerGroup`, by default for CPU ranks).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from raykv.cluster.control_plane import make_worker_group
from raykv.cluster.rank_actor import (
    READY_TIMEOUT_S,
    RankInfo,
    spawn_rank_worker,
)
from raykv.cluster.shared_store import kill_master, kill_node_store, scheduler_index
from raykv.config import ConfigError, RaykvConfig
from raykv.core.request import REJECTED, Request
from raykv.core.step import TokenLogprobs
from raykv.faults import (
    SchedulerFault,
    parse_fault,
    scheduler_dies_at,
    scheduler_fails_at,
    strikes_at,
)

if TYPE_CHECKING:
    from raykv.runs.report import RunReport

log = logging.getLogger(__name__)

DRAIN_S = 30.0  # at shutdown, how long transfers left by finished requests may take to land

# (request id, generated tokens, status, why it was refused, logprobs per token)
FinishedItem = tuple[str, list[int], str, "str | None", "list[TokenLogprobs] | None"]


def _logprobs(req: Request) -> list[TokenLogprobs] | None:
    wanted = req.sampling is not None and req.sampling.logprobs is not None
    return list(req.logprobs) if wanted else None


class EngineServer:
    """The scheduler actor: engine core, connector scheduler half and directory.

    ``run`` drives a workload to the end; ``submit`` + ``start`` run a loop thread that serves
    requests as they come, and ``take_finished`` streams their outputs. The actor is threaded
    (created with ``max_concurrency``), so ``progress`` and ``take_*`` answer while a run goes on.
    """

    def __init__(
        self,
        cfg: dict[str, Any],
        workers: list[Any],
        verify: bool | None = None,
        check_invariants: bool = False,
        offload: bool | None = None,
        placement: Any = None,
        incarnation: int = 0,
        first_bundle: int = 0,
        metric_labels: dict[str, str] | None = None,
        digest: bool = True,
        answer_refusal: bool = False,
    ) -> None:
        """``incarnation``: how many schedulers died before this one (a ``kill-scheduler``
        fault kills only the first). ``first_bundle``: rank 0's bundle in ``placement``
        (replacements go where their predecessors were). ``metric_labels``: tags on every
        metric of this engine (a Serve replica's id). ``digest``: keep the outputs' digest (a
        server does not: ``Driver``). ``answer_refusal``: a configuration error while it is
        built is kept for ``refused`` to answer, not raised (an actor's failed creation reaches
        its creator as a traceback)."""
        self._refused: str | None = None
        try:
            self._build(
                cfg,
                workers,
                verify,
                check_invariants,
                offload,
                placement,
                incarnation,
                first_bundle,
                metric_labels,
                digest,
            )
        except ConfigError as exc:
            if not answer_refusal:
                raise
            self._refused = str(exc)

    def refused(self) -> str | None:
        """The configuration error that kept it from being built (None: built)."""
        return self._refused

    def _build(
        self,
        cfg: dict[str, Any],
        workers: list[Any],
        verify: bool | None,
        check_invariants: bool,
        offload: bool | None,
        placement: Any,
        incarnation: int,
        first_bundle: int,
        metric_labels: dict[str, str] | None,
        digest: bool,
    ) -> None:
        from raykv.cluster.metrics import EngineMetrics
        from raykv.engine.core import EngineCore
        from raykv.runs.driver import Driver

        self.cfg = RaykvConfig.model_validate(cfg)
        self._cfg_json = cfg
        self._placement = placement
        self._incarnation = incarnation
        self._first_bundle = first_bundle
        # called after each step of the serving loop, under the lock (a Serve replica hands
        # its streams their new tokens from here)
        self.on_step: Callable[[], None] | None = None
        # called once if the serving loop ends on an error (a replica fails its streams)
        self.on_stopped: Callable[[], None] | None = None
        self._faults = [parse_fault(f) for f in self.cfg.faults]
        self.group = make_worker_group(self.cfg, workers, self._spawn)
        try:
            # the scheduler's own client of the shared tier: it asks which chunks the store holds
            self.group.store_index = scheduler_index(self.cfg) if offload is not False else None
            self.engine = EngineCore(self.cfg, self.group, verify=verify, offload=offload)
        except BaseException:
            # a failed creation leaves no graph behind: its ranks would wait in it, and the
            # actor's process with them; nor a client of the store
            self.group.shutdown()
            if self.group.store_index is not None:
                self.group.store_index.close()
            raise
        self.driver = Driver(self.engine, check_invariants=check_invariants, digest=digest)
        self.metrics = EngineMetrics(self.engine, metric_labels)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._loop: threading.Thread | None = None
        self._stop = False
        self._error: str | None = None

    @property
    def lock(self) -> threading.RLock:
        """The lock the serving loop steps under: who holds it sees the engine between two
        steps (a Serve replica admits requests and reads its KV state under it)."""
        return self._lock

    @property
    def error(self) -> str | None:
        """Why the serving loop ended, if it ended on an error; None while it serves."""
        return self._error

    # ---- batch runs -----------------------------------------------------------------------

    def run(self, specs: list[Any]) -> RunReport:
        """Run these requests to the end (every job acked) and return the report."""
        with self._lock:
            self.driver.submit(specs)
        while True:
            with self._lock:
                if not self.driver.has_work():
                    break
                self._step()
                # a batch run reports outputs in its digest and refusals in its report only
                self.driver.take_finished()
                self.driver.take_rejected()
        return self.report()

    def _step(self) -> None:
        self.driver.step()
        self.metrics.update()
        steps = self.engine.totals.steps
        if scheduler_dies_at(self._faults, steps, self._incarnation):
            os._exit(1)  # an injected death is a real one: the process goes, state and all
        if scheduler_fails_at(self._faults, steps):
            raise SchedulerFault(f"fail-scheduler: step {steps} failed (an injected fault)")
        # the first scheduler's step N only (a replacement replays the run from step 0)
        if self._incarnation == 0 and strikes_at(self._faults, "kill-shared-master", steps):
            kill_master()
        if self._incarnation == 0 and strikes_at(self._faults, "kill-store-actor", steps):
            kill_node_store(ray.get_runtime_context().get_node_id())

    def progress(self) -> dict[str, Any]:
        from raykv.runs.driver import progress_of

        return {**progress_of(self.driver), "error": self._error}

    def report(self) -> RunReport:
        with self._lock:
            report = self.driver.report()
        report.engine = "ray"
        report.control_plane = self.group.control_plane
        return report

    # ---- serving ----------------------------------------------------------------------------

    def submit(self, specs: list[Any]) -> int:
        with self._wake:
            self.driver.submit(specs)
            self._wake.notify_all()
            return self.driver.submitted

    def start(self) -> None:
        """Serve submitted requests from a loop thread until ``stop``."""
        if self._loop is None:
            self._loop = threading.Thread(target=self._serve, name="raykv-engine", daemon=True)
            self._loop.start()

    def _serve(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stop and not self.driver.has_work():
                        self._wake.wait(timeout=0.5)
                    if self._stop:
                        return
                    self._step()
                    if self.on_step is not None:
                        self.on_step()
        except Exception as exc:  # surfaced through progress(); the actor stays up to report it
            # the whole story goes to this process's log; ``error`` is for operators too, and
            # a server tells its clients only that the engine stopped
            log.exception("the engine's serving loop stopped")
            self._error = f"{type(exc).__name__}: {exc}"
            if self.on_stopped is not None:
                self.on_stopped()

    @property
    def serving(self) -> bool:
        """Whether the serving loop runs (started, not stopped, not ended by an error)."""
        return self._loop is not None and self._loop.is_alive() and self._error is None

    def take_finished(self) -> list[FinishedItem]:
        """Requests finished or refused since the last call: (request id, tokens, status,
        reason, logprobs). A refused request (bad token id, too long, an id the engine still
        holds) has status ``rejected``, no tokens and the engine's error as its reason; None
        otherwise. ``logprobs``: one per generated token, for a request that asked for them
        (a real model's ``SamplingSpec.logprobs``), else None."""
        with self._lock:
            out: list[FinishedItem] = [
                (r.req_id, list(r.output), r.status.value, None, _logprobs(r))
                for r in self.driver.take_finished()
            ]
            refused = self.driver.take_rejected()
            out += [(r["request"], [], REJECTED, r["error"], None) for r in refused]
            return out

    def take_events(self) -> list[Any]:
        """KV events (BlockStored / BlockRemoved, with sequence numbers; GPU prefix cache and
        CPU tier) since the last call."""
        with self._lock:
            return self.engine.events.take()

    def abort(self, req_id: str) -> bool:
        """Stop a request now (see ``Driver.abort``)."""
        with self._lock:
            return self.driver.abort(req_id)

    def idle(self) -> bool:
        with self._lock:
            return not self.driver.has_work()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._loop is not None:
            self._loop.join(timeout=30)

    def shutdown(self) -> None:
        """Before the ranks are shut down: transfers in flight once every request is done (the
        last stores, the shared tier's publishes) land first, for at most ``DRAIN_S``; the CPU
        tier is spilled to the disk tier (``EngineCore.stop``, for at most
        ``offload.disk.spill_on_stop_s``: the next engine on the path starts warm); then the
        loop stops and the compiled graph, if any, is torn down."""
        deadline = time.monotonic() + DRAIN_S
        while self._loop is not None and self._error is None and time.monotonic() < deadline:
            with self._lock:
                scheduler = self.engine.scheduler
                if scheduler.has_unfinished() or not self.driver.has_work():
                    break  # requests still running are stopped, not waited for
            time.sleep(0.05)
        if self._error is None:
            with self._lock:  # between two steps of the serving loop, if it runs
                try:
                    self.engine.stop()
                except Exception as exc:  # a stop goes on whatever the spill met
                    log.warning("the spill to the disk tier at the stop failed: %s", exc)
        self.stop()
        with self._lock:
            self.group.shutdown()
            if self.group.store_index is not None:
                self.group.store_index.close()
                self.group.store_index = None

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self.engine.reset_prefix_cache()

    def latency_of(self, req_id: str) -> tuple[float, int] | None:
        """A request's TTFT and tier hit tokens (CPU and disk), once it has its first token."""
        with self._lock:
            record = self.engine.latency.record_of(req_id)
            if record is None:
                return None
            return record.ttft_s, record.cpu_hit_tokens + record.disk_hit_tokens

    def spill_to_disk(self) -> None:
        """``EngineCore.spill_to_disk`` between two steps of the serving loop."""
        with self._lock:
            self.engine.spill_to_disk()

    def ping(self) -> float:
        return time.time()

    def books(self) -> dict[str, int]:
        """What must all be 0 once a run has drained (``engine.stats.drain_books``)."""
        from raykv.engine.stats import drain_books

        with self._lock:
            return drain_books(self.engine)

    def verify_cpu_tier(self) -> tuple[int, int]:
        """Every rank's CPU-pool shard against what each readable chunk must hold: (blocks
        checked, mismatches). The directory must never serve a key whose bytes are gone."""
        with self._lock:
            items = self.engine.cpu_tier_contents()
            refs = [w.verify_cpu_tier.remote(items) for w in self.group.workers]
            results = ray.get(refs, timeout=READY_TIMEOUT_S)
        return sum(r[0] for r in results), sum(r[1] for r in results)

    def workers(self) -> list[Any]:
        """The rank actors now serving (replaced ones included)."""
        return list(self.group.workers)

    def _spawn(self, rank: int, incarnation: int, before: RankInfo) -> Any:
        return spawn_rank_worker(
            self._cfg_json,
            rank,
            incarnation,
            self._placement,
            before.pool_path,
            before.process,
            self._first_bundle,
        )
