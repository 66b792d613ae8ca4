"""The client API: start a deployment, run or serve requests, stream outputs and KV events."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from raykv.cluster.engine_actor import EngineServer, FinishedItem
from raykv.cluster.rank_actor import READY_TIMEOUT_S, rank_bundle, ranks_ready, spawn_ranks
from raykv.cluster.runtime import RayHandle, connect
from raykv.config import ConfigError, RaykvConfig
from raykv.core.request import REJECTED
from raykv.core.step import SamplingSpec, TokenLogprobs
from raykv.transfer.pool_files import PoolFiles, sweep_stale
from raykv.workload.requests import RequestSpec

if TYPE_CHECKING:
    from raykv.runs.generate import Generation, Output, Prompt
    from raykv.runs.report import RunReport
    from raykv.workload.chat import ChatSession

log = logging.getLogger(__name__)

# The scheduler actor is replaced at most this many times in one client's life: a scheduler that
# keeps dying (a bug that some request triggers every time) must surface, not loop.
MAX_SCHEDULER_RESTARTS = 3


def config_error_in(exc: BaseException) -> ConfigError | None:
    """The configuration error an actor raised, where ``exc`` (Ray's wrapping of an actor's
    failure) carries one among its causes."""
    seen: set[int] = set()
    stack: list[object] = [exc]
    while stack:
        here = stack.pop()
        if not isinstance(here, BaseException) or id(here) in seen:
            continue
        seen.add(id(here))
        if isinstance(here, ConfigError):
            return here
        stack += [getattr(here, "cause", None), here.__cause__, here.__context__]
    return None


class DeploymentError(RuntimeError):
    """The deployment could not start (no resources, an actor failed to come up)."""


class StreamItem(tuple):
    """One request out of ``RaykvClient.stream``: unpacks as ``(req_id, tokens, status)``.

    ``status`` is the request's final status (``finished_length``, ``finished_stopped``, ...)
    or ``rejected`` for a request that was refused (bad token id, too long for the GPU pool,
    duplicate id); then ``tokens`` is empty and ``reason`` says why (None otherwise)."""

    reason: str | None
    logprobs: list[TokenLogprobs] | None  # per generated token, when the request asked

    def __new__(
        cls,
        req_id: str,
        tokens: list[int],
        status: str,
        reason: str | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> StreamItem:
        item = super().__new__(cls, (req_id, tokens, status))
        item.reason = reason
        item.logprobs = logprobs
        return item

    @property
    def req_id(self) -> str:
        return self[0]

    @property
    def tokens(self) -> list[int]:
        return self[1]

    @property
    def status(self) -> str:
        return self[2]

    def __repr__(self) -> str:
        why = f", reason={self.reason!r}" if self.reason is not None else ""
        return f"StreamItem({self[0]!r}, {self[1]!r}, {self[2]!r}{why})"


class RaykvClient:
    """A running raykv deployment: one worker actor per rank in a placement group (packed on one
    node by default), and one scheduler actor.

    ``RaykvClient.start(cfg)`` starts (or joins) Ray and the actors; ``run(specs)`` replays a
    workload and returns the report; ``submit`` + ``stream`` serve requests as they come;
    ``events`` returns the CPU tier's KV events; ``shutdown`` tears everything down.

    If the scheduler actor dies, the client replaces the whole deployment (the rank actors'
    state belongs to the dead scheduler's jobs) and carries on: ``stream`` resubmits every
    request it has not yielded yet, ``run`` runs its workload again. The model is
    deterministic, so every request still gets its tokens; what the CPU tier held is lost, and
    KV events start a new sequence.
    """

    def __init__(
        self,
        cfg: RaykvConfig,
        ray_handle: RayHandle,
        pg: Any,
        actor_options: dict[str, Any],
    ) -> None:
        self.cfg = cfg
        self._ray = ray_handle
        self._pg = pg
        self._options = actor_options  # verify, check_invariants, offload
        self._pool_files: PoolFiles | None = None
        self.workers: list[Any] = []
        self.server: Any = None
        self._serving = False
        self._unfinished: dict[str, RequestSpec] = {}  # submitted, not yet yielded by stream
        self._refused: list[StreamItem] = []  # refused here (duplicate ids), not yet yielded
        self.scheduler_restarts = 0
        self._generations = 0  # generate() calls so far (each names its requests apart)
        self._submissions = 0  # submit() calls so far (stream notices one made while it yields)

    @classmethod
    def start(
        cls,
        cfg: RaykvConfig,
        *,
        address: str | None = None,
        verify: bool | None = None,
        check_invariants: bool = False,
        offload: bool | None = None,
    ) -> RaykvClient:
        tp = cfg.parallel.tensor_parallel_size
        cuda = cfg.parallel.device == "cuda"
        handle = connect(address, num_cpus=max(tp, 1) if not cuda else 1)
        bundle = rank_bundle(cfg)
        pg = placement_group([dict(bundle) for _ in range(tp)], cfg.parallel.placement_strategy)
        try:
            ray.get(pg.ready(), timeout=READY_TIMEOUT_S)
        except Exception as exc:
            remove_placement_group(pg)
            handle.shutdown()
            raise DeploymentError(
                f"cannot place {tp} ranks needing {bundle} each with "
                f"{cfg.parallel.placement_strategy} (cluster has {ray.cluster_resources()}): {exc}"
            ) from exc
        options = {"verify": verify, "check_invariants": check_invariants, "offload": offload}
        client = cls(cfg, handle, pg, options)
        try:
            client._deploy()
        except Exception as exc:
            client.shutdown()
            bad_config = config_error_in(exc)
            if bad_config is not None:  # a key at fault, found by an actor: one line naming it
                raise ConfigError(str(bad_config)) from None
            raise DeploymentError(f"raykv actors failed to start: {exc}") from exc
        return client

    def _deploy(self) -> None:
        """Create the rank actors (fresh CPU-pool shards) and the scheduler actor."""
        cfg, o = self.cfg, self._options
        cfg_json = cfg.model_dump(mode="json")
        if cfg.offload.shared_pool and cfg.offload.enabled and o["offload"] is not False:
            sweep_stale(cfg.offload.shared_pool_dir)
            self._pool_files = PoolFiles.new(cfg.offload.shared_pool_dir)
        self.workers = spawn_ranks(cfg_json, self._pg, self._pool_files)
        ranks_ready(self.workers)  # a rank that refused its configuration: ConfigError
        server_cls = ray.remote(EngineServer)
        self.server = server_cls.options(num_cpus=0, max_concurrency=8).remote(
            cfg_json,
            self.workers,
            o["verify"],
            o["check_invariants"],
            o["offload"],
            self._pg,
            self.scheduler_restarts,
            answer_refusal=True,
        )
        refused = ray.get(self.server.refused.remote(), timeout=READY_TIMEOUT_S)
        if refused is not None:
            raise ConfigError(refused)

    def _replace_deployment(self, cause: Exception) -> None:
        """The scheduler actor died: tear down what is left and deploy anew."""
        self.scheduler_restarts += 1
        if self.scheduler_restarts > MAX_SCHEDULER_RESTARTS:
            raise RuntimeError(
                f"the scheduler actor died {self.scheduler_restarts} times; last: {cause}"
            ) from cause
        log.warning("the scheduler actor died (%s); deploying a new one", cause)
        self._teardown_actors()
        self._deploy()
        if self._serving:
            ray.get(self.server.start.remote())
            # they arrived long ago: due now
            again = [
                dataclasses.replace(s, arrival=0, arrival_s=None) for s in self._unfinished.values()
            ]
            if again:
                ray.get(self.server.submit.remote(again))

    @property
    def metrics_url(self) -> str | None:
        """The Prometheus endpoint of the embedded Ray instance (None when joining a cluster:
        scrape its nodes' metrics agents as usual)."""
        return self._ray.metrics_url

    # ---- batch ----------------------------------------------------------------------------

    def run(
        self,
        specs: Sequence[RequestSpec],
        progress: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = 0.25,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """``run_report``, with the report in its JSON shape (``RunReport.as_dict``)."""
        return self.run_report(specs, progress, poll_s, timeout_s).as_dict()

    def run_report(
        self,
        specs: Sequence[RequestSpec],
        progress: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = 0.25,
        timeout_s: float | None = None,
    ) -> RunReport:
        """Run ``specs`` to the end on the deployment; returns the run report. If the scheduler
        actor dies, the run starts over on a new deployment."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                report = self._run_once(specs, progress, poll_s, deadline, timeout_s)
                break
            except ray.exceptions.RayActorError as exc:
                self._replace_deployment(exc)
        return self._with_client_fields(report)

    def _with_client_fields(self, report: RunReport) -> RunReport:
        """What only the client knows: the per-rank detail and the scheduler restarts."""
        report.ranks_detail = self.rank_report(report)
        report.scheduler_restarts = self.scheduler_restarts
        return report

    def _run_once(
        self,
        specs: Sequence[RequestSpec],
        progress: Callable[[dict[str, Any]], None] | None,
        poll_s: float,
        deadline: float | None,
        timeout_s: float | None,
    ) -> RunReport:
        ref = self.server.run.remote(list(specs))
        while True:
            ready, _ = ray.wait([ref], timeout=poll_s)
            if progress is not None:
                progress(ray.get(self.server.progress.remote(), timeout=60))
            if ready:
                return ray.get(ref)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run still going after {timeout_s} s")

    def rank_report(self, report: RunReport) -> list[dict[str, Any]]:
        return [{"rank": i, **stats} for i, stats in enumerate(report.ranks)]

    # ---- serving ----------------------------------------------------------------------------

    def submit(self, specs: Sequence[RequestSpec]) -> None:
        """Queue requests; they are served as they arrive (``arrival`` 0 means now).

        A request whose id is still in use (submitted and not yet yielded by ``stream``) is
        refused here without touching the first one: ``stream`` yields it as ``rejected``."""
        self._submissions += 1
        accepted = []
        for spec in specs:
            if spec.req_id in self._unfinished:
                reason = (
                    f"duplicate request id {spec.req_id!r}: a request with this id was "
                    "submitted and has not finished"
                )
                self._refused.append(StreamItem(spec.req_id, [], REJECTED, reason))
                continue
            self._unfinished[spec.req_id] = spec
            accepted.append(spec)
        specs = accepted
        try:
            if not self._serving:
                ray.get(self.server.start.remote())
                self._serving = True
            ray.get(self.server.submit.remote(specs))
        except ray.exceptions.RayActorError as exc:
            self._serving = True
            self._replace_deployment(exc)  # resubmits these with the rest

    def stream(self, timeout_s: float = 600.0, poll_s: float = 0.05) -> Iterator[StreamItem]:
        """Yield a ``StreamItem`` (request id, generated tokens, status) as each request
        finishes or is refused, until every submitted request has been yielded and every
        transfer is acked. Every submission is yielded exactly once: a refused one (bad token
        id, too long, duplicate id) with status ``rejected`` and its ``reason``. The caller
        may submit more while iterating (a chat's next turn): they are yielded too."""
        deadline = time.monotonic() + timeout_s
        while True:
            while self._refused:
                yield self._refused.pop(0)
            submitted = self._submissions
            try:
                items, idle = self._poll_finished()
            except ray.exceptions.RayActorError as exc:
                self._replace_deployment(exc)
                continue
            for req_id, tokens, status, reason, logprobs in items:
                # a request the dead scheduler finished but never handed over is recomputed
                # and comes again: yield each request once. A refused one leaves the table
                # too, so a new scheduler is never handed it again
                if self._unfinished.pop(req_id, None) is not None:
                    yield StreamItem(req_id, tokens, status, reason, logprobs)
            # idle was read before the yields: a submission since then is work again
            if idle and not self._refused and self._submissions == submitted:
                if self._unfinished:  # a bug: the engine forgot requests it was given
                    lost = sorted(self._unfinished)
                    raise RuntimeError(
                        f"the engine went idle with {len(lost)} requests neither finished nor "
                        f"refused: {lost[:10]}"
                    )
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests still running after {timeout_s} s")
            time.sleep(poll_s)

    def _poll_finished(self) -> tuple[list[FinishedItem], bool]:
        items = ray.get(self.server.take_finished.remote())
        progress = ray.get(self.server.progress.remote())
        if progress["error"]:
            raise RuntimeError(f"the engine stopped: {progress['error']}")
        idle = ray.get(self.server.idle.remote())
        if idle:  # what finished between the first call and now
            items += ray.get(self.server.take_finished.remote())
        return items, idle

    def generate(
        self,
        prompts: Sequence[Prompt],
        max_tokens: int = 64,
        *,
        sequential: bool = False,
        sampling: SamplingSpec | None = None,
        timeout_s: float = 600.0,
    ) -> list[Output]:
        """Prompts (texts, chat messages or token ids) through the deployment's real model:
        texts, token ids and, with ``sampling.logprobs``, logprobs out, in the prompts' order.
        All prompts are submitted at once, or with ``sequential`` each once the previous one
        finished, so that it can reuse their KV. A refused prompt comes out with
        ``finish_reason`` ``rejected`` and the reason."""
        from raykv.runs.generate import prepare

        if self.cfg.model.path is None:
            raise ValueError("generate needs a real model (model.path)")
        gen = prepare(self.cfg, list(prompts), max_tokens, sampling)
        return self.run_generation(gen, sequential=sequential, timeout_s=timeout_s)

    def run_generation(
        self, gen: Generation, *, sequential: bool = False, timeout_s: float = 600.0
    ) -> list[Output]:
        """``generate`` for prompts already made ready (``engine.generate.prepare``, on the
        config this deployment serves)."""
        batches = [[s] for s in gen.specs] if sequential else [gen.specs]
        outputs: dict[int, Output] = {}
        for batch in batches:
            # this client's request ids may be taken by earlier calls: name them apart
            tag = f"gen{self._generations}-"
            self._generations += 1
            self.submit([dataclasses.replace(s, req_id=tag + s.req_id) for s in batch])
            for item in self.stream(timeout_s=timeout_s):
                index = int(item.req_id.removeprefix(tag))
                outputs[index] = gen.output(
                    index, item.tokens, item.status, item.reason, item.logprobs
                )
        return [outputs[i] for i in range(len(gen.specs))]

    def run_chat(
        self,
        session: ChatSession,
        progress: Callable[[dict[str, Any]], None] | None = None,
        timeout_s: float = 3600.0,
    ) -> RunReport:
        """Run a chat session (``workload/chat.py``): each answered turn submits the turns it
        unblocks; returns the report of every turn."""
        self.submit(session.start())
        for item in self.stream(timeout_s=timeout_s):
            follow = session.answered(item.req_id, item.tokens)
            if follow:
                self.submit(follow)
            if progress is not None:
                progress(self.progress())
        return self._with_client_fields(ray.get(self.server.report.remote(), timeout=60))

    def events(self) -> list[Any]:
        """KV events since the last call (BlockStored / BlockRemoved; medium GPU for the prefix
        cache, CPU for the CPU tier; one sequence)."""
        return ray.get(self.server.take_events.remote())

    def progress(self) -> dict[str, Any]:
        return ray.get(self.server.progress.remote())

    def report(self) -> dict[str, Any]:
        """The run report so far, in its JSON shape."""
        return ray.get(self.server.report.remote()).as_dict()

    # ---- teardown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the loop, the actors and the placement group; stop Ray if raykv started it."""
        self._teardown_actors()
        with contextlib.suppress(Exception):
            remove_placement_group(self._pg)
        self._ray.shutdown()

    def _teardown_actors(self) -> None:
        # an actor already gone must not keep the rest alive; ranks the scheduler replaced are
        # its own actors and go with it
        with contextlib.suppress(Exception):
            # its loop, its graph, and the spill of the CPU tier to the disk tier
            stop_s = 60 + self.cfg.offload.disk.spill_on_stop_s
            ray.get(self.server.shutdown.remote(), timeout=stop_s)
            self.workers = ray.get(self.server.workers.remote(), timeout=60)
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        for actor in [self.server, *self.workers]:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        if self._pool_files is not None:  # shards of ranks that died without cleaning up
            self._pool_files.remove()

    def __enter__(self) -> RaykvClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
