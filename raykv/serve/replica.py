"""One raykv replica under Ray Serve: an engine whose scheduler runs in the replica's process
and whose tensor-parallel ranks are actors in the replica's placement group (bundle 0 is the
replica itself, bundles 1..TP its ranks, all on one node).

Requests come in as ``EngineRequest`` (token ids, already through the chat template) and go out
as a stream of ``EngineUpdate``: text deltas with their token ids and logprobs, then the finish
reason with the prompt's cached tokens. The scheduler's loop thread hands each stream its new
tokens after every step; a stop string or a client that goes away aborts the request in the
engine at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray

from raykv.cluster.engine_actor import EngineServer
from raykv.cluster.rank_actor import READY_TIMEOUT_S, spawn_ranks
from raykv.config import RaykvConfig
from raykv.core.request import Request, RequestStatus
from raykv.core.step import SamplingSpec, TokenLogprobs
from raykv.model.tokenizer import Tokenizer
from raykv.serve.kv_feed import FeedPusher, Load, feed_name, start_feed
from raykv.serve.kv_index import Snapshot, WireEvent, to_wire
from raykv.serve.text_stream import TextStream
from raykv.transfer.pool_files import PoolFiles, sweep_stale
from raykv.workload.requests import RequestSpec

# the replica's own process takes bundle 0 of its placement group; its ranks the ones after it
FIRST_RANK_BUNDLE = 1
# how often a waiting stream checks that the engine's loop is still alive
ENGINE_CHECK_S = 1.0


@dataclass(slots=True)
class EngineRequest:
    """A request as the ingress hands it to a replica. ``prompt`` is the prompt as text (what
    a text-prefix router such as Ray Serve LLM's ``PrefixCacheAffinityRouter`` reads);
    ``max_tokens`` None: as many as the context and the GPU pool allow."""

    request_id: str
    token_ids: list[int]
    max_tokens: int | None
    sampling: SamplingSpec
    stop: list[str] = field(default_factory=list)
    prompt: str = ""


@dataclass(slots=True)
class TokenInfo:
    """One generated token with its log-probability and the top alternatives (text, logprob)."""

    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass(slots=True)
class EngineUpdate:
    """A piece of one request's stream. The last has ``finish_reason`` (stop, length, abort) or
    ``error`` with its HTTP ``status``."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenInfo] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt: from the GPU prefix cache, then the CPU tier
    cpu_tier_tokens: int = 0  # of those, from the CPU tier
    error: str | None = None
    status: int = 200
    replica: str = ""  # the Serve replica that answered


@dataclass(slots=True)
class _Stream:
    """A request being served: where its updates go and how far they got."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]
    delivered: int = 0  # output tokens handed to the queue


class EngineReplica:
    """The body of the engine deployment: one engine, many concurrent streams."""

    def __init__(self, cfg_json: dict[str, Any], model_file: str) -> None:
        """``cfg_json``: the served config (``serve.app.served_config``); ``model_file``: the
        checkpoint, whose tokenizer turns token ids back into text."""
        cfg = RaykvConfig.model_validate(cfg_json)
        self.tokenizer = Tokenizer.of(model_file, cfg.model.cache_dir)
        pg = ray.util.get_current_placement_group()
        self._pool_files: PoolFiles | None = None
        if cfg.offload.enabled and cfg.offload.shared_pool:
            sweep_stale(cfg.offload.shared_pool_dir)
            self._pool_files = PoolFiles.new(cfg.offload.shared_pool_dir)
        workers = spawn_ranks(cfg_json, pg, self._pool_files, FIRST_RANK_BUNDLE)
        ray.get([w.ready.remote() for w in workers], timeout=READY_TIMEOUT_S)
        self.replica = _replica_id()
        labels = {"replica": self.replica} if self.replica else None
        self.server = EngineServer(
            cfg_json, workers, placement=pg, first_bundle=FIRST_RANK_BUNDLE, metric_labels=labels
        )
        self._streams: dict[str, _Stream] = {}
        self._refused_seen = 0  # the driver's refusals already handed to their streams
        self._ids = itertools.count()
        self._closed = False
        self._feed: Any = None
        self._pusher: FeedPusher | None = None
        self.server.on_step = self._pump
        self.server.start()
        if self.replica:
            self._start_feed(pg)

    def _start_feed(self, pg: Any) -> None:
        """The replica's KV feed (``serve.kv_feed``), named for its Serve replica id, and the
        thread that pushes to it."""
        from ray import serve

        app_name = serve.get_replica_context().replica_id.deployment_id.app_name
        name = feed_name(app_name, self.replica)
        self._feed = start_feed(name, ray.get_runtime_context().namespace, pg)
        self._pusher = FeedPusher(self._feed, self._collect_kv)

    def _collect_kv(self, whole: bool) -> tuple[list[WireEvent] | Snapshot, Load]:
        """The engine's KV events since the last call (or, ``whole``, its state as a whole),
        with its load: for the feed pusher's thread."""
        with self.server.lock:
            engine = self.server.engine
            events = engine.events.take()
            load = Load(*self.server.driver.load())
            if not whole:
                return to_wire(events), load
            next_seq, held = engine.kv_state()
            return Snapshot(next_seq, held), load

    # ---- requests ---------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineUpdate]:
        """The request's updates as the engine produces them (a Serve streaming method)."""
        engine_id = f"{request.request_id}#{next(self._ids)}"  # unique even if a client reuses
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        try:
            self._admit(engine_id, request, stream)
        except ValueError as exc:
            yield EngineUpdate(error=str(exc).replace(engine_id, request.request_id), status=400)
            return
        text = TextStream(self._decode, list(request.stop))
        finished = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(stream.queue.get(), ENGINE_CHECK_S)
                except asyncio.TimeoutError:
                    if self.server.error is not None:  # the loop thread ended on an error
                        item = f"the engine stopped: {self.server.error}"
                    else:
                        continue
                if isinstance(item, str):  # refused after all, or the engine stopped
                    finished = True
                    yield EngineUpdate(error=item, status=503 if "stopped" in item else 400)
                    return
                tokens, logprobs, status, cached = item
                before = len(text.tokens)
                update = EngineUpdate(text.push(tokens), replica=self.replica)
                update.token_ids = text.tokens[before:]
                if logprobs is not None:  # text only here, off the engine's loop and lock
                    update.logprobs = [
                        self._token_info(t, lp)
                        for t, lp in zip(update.token_ids, logprobs, strict=False)
                    ]
                if text.stopped:
                    self.server.abort(engine_id)
                    update.finish_reason = "stop"
                elif status is not None:
                    update.text += text.finish()
                    update.finish_reason = _finish_reason(status)
                if update.finish_reason is not None:
                    update.prompt_tokens = len(request.token_ids)
                    update.completion_tokens = len(text.tokens)
                    update.cached_tokens = sum(cached)
                    update.cpu_tier_tokens = cached[1]
                    finished = True
                    yield update
                    return
                if update.text or update.token_ids:
                    yield update
        finally:
            with self.server.lock:
                self._streams.pop(engine_id, None)
            if not finished:  # the client went away
                self.server.abort(engine_id)

    def _admit(self, engine_id: str, request: EngineRequest, stream: _Stream) -> None:
        """Check the request against the engine and submit it; ValueError names what is wrong."""
        engine = self.server.engine
        with self.server.lock:
            if self._closed:
                raise ValueError("the replica is shutting down")
            max_tokens = request.max_tokens or self._room(engine_id, request.token_ids)
            engine.check_request(Request(engine_id, 0, list(request.token_ids), max_tokens))
            spec = RequestSpec(engine_id, tuple(request.token_ids), max_tokens, 0, request.sampling)
            self._streams[engine_id] = stream
            self.server.submit([spec])

    def _room(self, engine_id: str, token_ids: list[int]) -> int:
        """The most output tokens the engine accepts after this prompt (a request without
        ``max_tokens``); ValueError naming the limit when not even one fits."""
        engine = self.server.engine
        engine.check_request(Request(engine_id, 0, list(token_ids), 1))
        lo, hi = 1, 1 << 20
        while lo < hi:  # the largest n the engine's own checks accept
            mid = (lo + hi + 1) // 2
            try:
                engine.check_request(Request(engine_id, 0, list(token_ids), mid))
                lo = mid
            except ValueError:
                hi = mid - 1
        return lo

    def _decode(self, token_ids: Any) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    # ---- the engine's side (its loop thread, under its lock) ---------------------------------

    def _pump(self) -> None:
        """After each step: every stream's new tokens, and the end of those that finished or
        were refused."""
        driver = self.server.driver
        streams = self._streams
        for engine_id, stream in streams.items():
            req = driver.engine.requests.get(engine_id)
            if req is not None and not req.finished:
                self._hand(stream, req, None)
        for req in driver.take_finished():
            stream = streams.get(req.req_id)
            if stream is not None:
                self._hand(stream, req, req.status.value)
        refused = driver.rejected[self._refused_seen :]
        self._refused_seen += len(refused)
        for item in refused:
            stream = streams.get(item["request"])
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item["error"])

    def _hand(self, stream: _Stream, req: Request, status: str | None) -> None:
        """The request's tokens since the last hand-over (with their logprobs, when it asked
        for them), its status once it ended, and its cached prompt tokens at first admission
        (what OpenAI's usage reports)."""
        output = req.output
        new = output[stream.delivered :]
        if not new and status is None:
            return
        wanted = req.sampling is not None and req.sampling.logprobs is not None
        logprobs = req.logprobs[stream.delivered :] if wanted else None
        stream.delivered = len(output)
        cached = (req.num_gpu_hit_tokens, req.num_cpu_hit_tokens)
        item = (new, logprobs, status, cached)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _token_info(self, token_id: int, lp: TokenLogprobs) -> TokenInfo:
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])
        return TokenInfo(
            token_id,
            self._decode([token_id]),
            lp.logprob,
            [(t, self._decode([t]), v) for t, v in top],
        )

    # ---- routing and health -----------------------------------------------------------------

    def ping(self) -> bool:
        """Answers once the replica is up (its engine built, its ranks ready)."""
        return self.server.error is None

    def info(self) -> dict[str, Any]:
        """Where this replica runs: its Serve id, its node, its ranks' process ids."""
        return {
            "replica": self.replica,
            "node": ray.get_runtime_context().get_node_id(),
            "ranks": self.rank_processes(),
        }

    def rank_processes(self) -> list[int]:
        """The process ids of this replica's rank actors now serving."""
        with self.server.lock:
            return [info.process[0] for info in self.server.group.infos]

    def __del__(self) -> None:
        """Serve calls this when it stops the replica: the loop, the graph, the ranks and
        their shard files go."""
        self.close()

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._pusher is not None:
            self._pusher.stop()
            with contextlib.suppress(Exception):
                ray.kill(self._feed)
        with contextlib.suppress(Exception):
            self.server.shutdown()
        workers = self.server.group.workers  # replacements included
        with contextlib.suppress(Exception):
            ray.get([w.shutdown.remote() for w in workers], timeout=60)
        for worker in workers:
            with contextlib.suppress(Exception):
                ray.kill(worker)
        if self._pool_files is not None:
            self._pool_files.remove()


def _replica_id() -> str:
    """This Serve replica's id; empty outside Serve."""
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return ""


def _finish_reason(status: str) -> str:
    if status == RequestStatus.FINISHED_STOPPED.value:
        return "stop"
    if status == RequestStatus.FINISHED_LENGTH.value:
        return "length"
    return "abort"
