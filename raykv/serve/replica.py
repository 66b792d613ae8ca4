"""One raykv replica under Ray Serve: an engine whose scheduler runs in the replica's process
and whose tensor-parallel ranks are actors in the replica's placement group (bundle 0 is the
replica itself, bundles 1..TP its ranks, all on one node).

Requests come in as ``EngineRequest`` (token ids, already through the chat template) and go out
as a stream of ``EngineUpdate``: text deltas with their token ids and logprobs, then the finish
reason with the prompt's cached tokens. The scheduler's loop thread hands each stream its new
tokens after every step; a stop string or a client that goes away aborts the request in the
engine at once. Turning tokens into text runs in a thread of the replica's, never on the event
loop its streams share.

A request at fault fails alone (a 400 naming its field, or a 500 if the engine could not
compute its next token). If the engine's loop ends anyway, every stream gets a 503, the replica
reports itself unhealthy (``check_health``) and Serve replaces it. No client ever reads an
internal error's text: it goes to this process's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray

from raykv.cluster.engine_actor import EngineServer
from raykv.cluster.rank_actor import ranks_ready, spawn_ranks
from raykv.config import RaykvConfig
from raykv.core.request import Request, RequestRefused, RequestStatus
from raykv.model.tokenizer import Tokenizer
from raykv.serve.grpc_bind import bind_replica_grpc_to_node
from raykv.serve.kv_feed import FeedPusher, Load, replica_feed
from raykv.serve.kv_index import Snapshot, WireEvent, to_wire
from raykv.serve.messages import EngineRequest, EngineUpdate
from raykv.serve.text_stream import TextStream
from raykv.serve.token_text import TokenText
from raykv.transfer.pool_files import PoolFiles, sweep_stale
from raykv.workload.requests import RequestSpec

log = logging.getLogger(__name__)

# the replica's own process takes bundle 0 of its placement group; its ranks the ones after it
FIRST_RANK_BUNDLE = 1
# how often a waiting stream checks that the engine's loop is still alive
ENGINE_CHECK_S = 1.0
# threads turning tokens into text. Decoding holds the GIL, but in a thread the interpreter
# switches every few milliseconds: a stream's text work (a long logprobs answer) never holds
# the loop all its streams share for longer; two keep one stream from waiting on another's
TEXT_THREADS = 2

# what a client is told when the engine is at fault (the details are in the replica's log)
ENGINE_STOPPED = "the engine of this replica stopped; it is being replaced, retry shortly"
SAMPLING_FAILED = "the engine could not compute this request's next token"


@dataclass(slots=True)
class _Refusal:
    """A stream's end by an error: what its client reads."""

    message: str
    status: int
    param: str | None = None


@dataclass(slots=True)
class _Stream:
    """A request being served: where its updates go and how far they got."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]
    request_id: str  # the client's id (the engine's is it with this replica's counter)
    delivered: int = 0  # output tokens handed to the queue

    def put(self, item: Any) -> None:
        """From the engine's loop thread."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def public(self, message: str) -> str:
        """An engine message as the client may read it: its request under the client's id."""
        return re.sub(re.escape(self.request_id) + r"#\d+", self.request_id, message)


class EngineReplica:
    """The body of the engine deployment: one engine, many concurrent streams."""

    def __init__(self, cfg_json: dict[str, Any], model_file: str) -> None:
        """``cfg_json``: the served config (``serve.app.served_config``); ``model_file``: the
        checkpoint, whose tokenizer turns token ids back into text."""
        bind_replica_grpc_to_node()  # before Serve starts it, once this returns
        cfg = RaykvConfig.model_validate(cfg_json)
        self.tokenizer = Tokenizer.of(model_file, cfg.model.cache_dir)
        pg = ray.util.get_current_placement_group()
        self._pool_files: PoolFiles | None = None
        if cfg.offload.enabled and cfg.offload.shared_pool:
            sweep_stale(cfg.offload.shared_pool_dir)
            self._pool_files = PoolFiles.new(cfg.offload.shared_pool_dir)
        workers = spawn_ranks(cfg_json, pg, self._pool_files, FIRST_RANK_BUNDLE)
        ranks_ready(workers)
        self.replica = _replica_id()
        self.texts = TokenText(self.tokenizer, self.replica)
        labels = {"replica": self.replica} if self.replica else None
        self.server = EngineServer(
            cfg_json,
            workers,
            placement=pg,
            first_bundle=FIRST_RANK_BUNDLE,
            metric_labels=labels,
            digest=False,  # the outputs went to their clients
        )
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._closed = False
        self._text = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="raykv-text")
        # admissions, aborts and stream ends: each waits for the engine's lock, in order
        self._engine_calls = ThreadPoolExecutor(1, thread_name_prefix="raykv-admit")
        self._pusher: FeedPusher | None = None
        self.server.on_step = self._pump
        self.server.on_stopped = self._fail_all
        self.server.start()
        if self.replica:  # its KV feed (``serve.kv_feed``), beside it in its placement group
            self._pusher = replica_feed(self.replica, self._collect_kv, pg)

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
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), request.request_id)
        # the engine's lock is held for whole steps: what takes it runs in a thread of its own,
        # never on the loop every stream of this replica shares
        refusal = await loop.run_in_executor(
            self._engine_calls, self._admit, engine_id, request, stream
        )
        if refusal is not None:
            yield _error_update(refusal)
            return
        text = TextStream(self.texts.decode, list(request.stop))
        finished = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(stream.queue.get(), ENGINE_CHECK_S)
                except asyncio.TimeoutError:
                    if self.server.serving:
                        continue
                    item = _Refusal(ENGINE_STOPPED, 503)  # in case its stream missed the end
                if isinstance(item, _Refusal):  # refused after all, or the engine stopped
                    finished = True
                    yield _error_update(item)
                    return
                tokens, logprobs, status, cached = item
                update = await self._in_text_thread(self.texts.update, text, tokens, logprobs)
                if text.stopped:
                    await loop.run_in_executor(self._engine_calls, self.server.abort, engine_id)
                    update.finish_reason = "stop"
                elif status is not None:
                    if status == RequestStatus.FINISHED_ERROR.value:
                        finished = True
                        yield _error_update(_Refusal(SAMPLING_FAILED, 500))
                        return
                    update.text += await self._in_text_thread(text.finish)
                    update.finish_reason = _finish_reason(status)
                if update.finish_reason is not None:
                    update.prompt_tokens = len(request.token_ids)
                    update.completion_tokens = len(text.tokens)
                    update.cached_tokens = sum(cached)
                    update.cpu_tier_tokens = cached[1]
                    update.disk_tier_tokens = cached[2]
                    update.shared_tier_tokens = cached[3]
                    finished = True
                    yield update
                    return
                if update.text or update.token_ids:
                    yield update
        finally:
            # not awaited: a generator closed by a client that went away cannot wait
            self._engine_calls.submit(self._end_stream, engine_id, finished)

    def _end_stream(self, engine_id: str, finished: bool) -> None:
        """A stream is over: forget it, and stop its request if its client went away."""
        with self.server.lock:
            self._streams.pop(engine_id, None)
        if not finished:
            self.server.abort(engine_id)

    async def _in_text_thread(self, work: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._text, work, *args)

    def _admit(self, engine_id: str, request: EngineRequest, stream: _Stream) -> _Refusal | None:
        """Check the request against the engine and submit it (in a thread: it waits for the
        engine's lock); the refusal, if it is refused."""
        engine = self.server.engine
        with self.server.lock:
            if self._closed:
                return _Refusal("the replica is shutting down", 503)
            if not self.server.serving:
                return _Refusal(ENGINE_STOPPED, 503)
            try:
                max_tokens = request.max_tokens or self._room(engine_id, request.token_ids)
                engine.check_request(
                    Request(
                        engine_id,
                        0,
                        list(request.token_ids),
                        max_tokens,
                        sampling=request.sampling,
                        cache_salt=request.cache_salt,
                    )
                )
            except ValueError as exc:
                field = exc.field if isinstance(exc, RequestRefused) else "prompt"
                return _Refusal(stream.public(str(exc)), 400, field)
            spec = RequestSpec(
                engine_id,
                tuple(request.token_ids),
                max_tokens,
                0,
                request.sampling,
                cache_salt=request.cache_salt,
            )
            self._streams[engine_id] = stream
            self.server.submit([spec])
        return None

    def _room(self, engine_id: str, token_ids: list[int]) -> int:
        """The most output tokens the engine accepts after this prompt (a request without
        ``max_tokens``): what the context leaves, cut to what the GPU pool holds beside the
        prompt; ValueError naming the limit when not even one fits."""
        engine = self.server.engine
        probe = Request(engine_id, 0, list(token_ids), 1)
        engine.check_request(probe)  # the prompt itself, scanned once
        context = engine.cfg.model.max_positions
        lo, hi = 1, (context - probe.num_prompt) if context is not None else 1 << 20
        while lo < hi:  # the pool's bound is block arithmetic: no scan of the prompt
            probe.max_tokens = (lo + hi + 1) // 2
            try:
                engine.scheduler.check_fits(probe)
                lo = probe.max_tokens
            except ValueError:
                hi = probe.max_tokens - 1
        return lo

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
        for item in driver.take_rejected():
            stream = streams.get(item["request"])
            if stream is not None:
                stream.put(_Refusal(stream.public(item["error"]), 400, item.get("field")))

    def _fail_all(self) -> None:
        """The engine's loop ended on an error: every stream ends in a 503 now, and the KV
        feed goes (routers then count this replica's KV as empty and its load as unknown,
        instead of sending it the prompts it held until Serve replaces it)."""
        for stream in list(self._streams.values()):
            stream.put(_Refusal(ENGINE_STOPPED, 503))
        if self._pusher is not None:
            self._pusher.end()

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
        # the engine counts a hit promoted from disk or the store apart from the CPU tier's own
        cached = (
            req.num_gpu_hit_tokens,
            req.num_cpu_hit_tokens,
            req.num_disk_hit_tokens,
            req.num_shared_hit_tokens,
        )
        stream.put((new, logprobs, status, cached))

    # ---- routing and health -----------------------------------------------------------------

    def check_health(self) -> None:
        """Serve's health check: raises once the engine's loop has ended (Serve then replaces
        this replica)."""
        if not self._closed and not self.server.serving:
            raise RuntimeError("the engine's serving loop has ended (see this replica's log)")

    def ping(self) -> bool:
        """Whether this replica serves: its engine built, its ranks ready, its loop alive."""
        return not self._closed and self.server.serving

    def info(self) -> dict[str, Any]:
        """Where this replica runs: its Serve id, its node, its ranks' process ids."""
        return {
            "replica": self.replica,
            "node": ray.get_runtime_context().get_node_id(),
            "ranks": self.rank_processes(),
        }

    def stats(self) -> dict[str, int]:
        """What this replica holds per request and per token (each bounded however long it
        serves; ``tests/serve/test_hostile_requests.py`` checks them) and its resident memory."""
        with self.server.lock:
            engine, driver = self.server.engine, self.server.driver
            scheduler = engine.scheduler
            latency = engine.latency
            return {
                "rss_bytes": _resident_bytes(),
                "streams": len(self._streams),
                "engine_requests": len(engine.requests),
                "waiting": len(scheduler.waiting),
                "running": len(scheduler.running),
                "loading": len(scheduler.loading),
                "free_gpu_blocks": engine.pool.num_free,
                "usable_gpu_blocks": engine.pool.num_usable,
                "ttft_kept": len(latency.ttft.kept),
                "itl_kept": len(latency.itl.kept),
                "ttft_count": latency.ttft.count,
                "itl_count": latency.itl.count,
                "latency_records": len(latency.requests),
                "rejected_kept": len(driver.rejected),
                "rejected_count": driver.rejected_count,
                "outputs_held": driver.outputs_held,
                "events_buffered": engine.events.buffered,
                "finished": driver.finished_count,
                "feeds_recreated": self._pusher.recreated if self._pusher is not None else 0,
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
            self._pusher.end()
        with contextlib.suppress(Exception):
            self.server.shutdown()
        self._text.shutdown(wait=False, cancel_futures=True)
        self._engine_calls.shutdown(wait=False, cancel_futures=True)
        workers = self.server.group.workers  # replacements included
        with contextlib.suppress(Exception):
            ray.get([w.shutdown.remote() for w in workers], timeout=60)
        for worker in workers:
            with contextlib.suppress(Exception):
                ray.kill(worker)
        if self._pool_files is not None:
            self._pool_files.remove()


def _error_update(refusal: _Refusal) -> EngineUpdate:
    return EngineUpdate(error=refusal.message, status=refusal.status, param=refusal.param)


def _resident_bytes() -> int:
    """This process's resident memory (Linux's /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


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
