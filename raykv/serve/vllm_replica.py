"""One vLLM replica under Ray Serve (``serve.engine: vllm``): vLLM's ``AsyncLLM`` with raykv's
tiers as its offloading spec, behind the same interface as raykv's own replica
(``serve/replica.py``): ``generate`` takes an ``EngineRequest`` and streams ``EngineUpdate``s,
``check_health``, ``ping``, ``info`` and ``stats`` answer the ingress and Serve, and the KV feed
tells routers what the replica holds.

The feed's events are vLLM's own KV event stream (its GPU prefix cache, and raykv's tiers as
the spec reports them), read from the engine's ZeroMQ socket by ``serve.vllm_events`` and
pushed to the replica's feed actor as raykv's engine's are. The replica's load (prompt tokens
waiting, requests decoding) is its own count of the streams it serves.

On vLLM's CPU platform the replica claims ``serve.replica_cpus`` cores of its machine
(``serve.cores``) and binds vLLM's threads to them, so replicas never share a core. Its sockets
are ``ipc://`` paths in a directory of its own, removed when it stops: nothing listens beyond
the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray

from raykv.config import RaykvConfig
from raykv.model.tokenizer import Tokenizer
from raykv.serve.cores import CoreClaim
from raykv.serve.grpc_bind import bind_replica_grpc_to_node
from raykv.serve.kv_feed import FeedPusher, Load, replica_feed
from raykv.serve.kv_index import KVLayout, PromptKeys, Snapshot, WireEvent, prompt_hit
from raykv.serve.messages import EngineRequest, EngineUpdate
from raykv.serve.replica import ENGINE_STOPPED, TEXT_THREADS, _replica_id, _resident_bytes
from raykv.serve.text_stream import TextStream
from raykv.serve.token_text import TokenText
from raykv.serve.vllm_events import EventSubscriber, VllmKVMirror

log = logging.getLogger(__name__)

ENGINE_FAILED = "the engine could not answer this request"


@dataclass(slots=True)
class _Counts:
    """The replica's load as routers weigh it, from the streams it serves."""

    prefill_tokens: int = 0  # prompt tokens of requests that have no token yet
    decoding: int = 0


class VllmReplica:
    """The body of the engine deployment with ``serve.engine: vllm``."""

    async def __init__(self, cfg_json: dict[str, Any], model_dir: str, hash_seed: str) -> None:
        """``cfg_json``: the served config; ``model_dir``: the Hugging Face directory vLLM
        loads (its tokenizer turns ids into text); ``hash_seed``: vLLM's block hash seed,
        the same for every replica and the router (empty: vLLM's default)."""
        bind_replica_grpc_to_node()
        cfg = RaykvConfig.model_validate(cfg_json)
        self.tokenizer = Tokenizer.of(model_dir, cfg.model.cache_dir)
        self.replica = _replica_id()
        self.texts = TokenText(self.tokenizer, self.replica)
        self._closed = False
        self._streams = 0
        self._counts = _Counts()
        self._ids = itertools.count()
        # Linux's abstract socket names: nothing on disk to leave behind, however it ends
        self._sockets = f"@raykv-vllm-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._claim: CoreClaim | None = None
        self._pusher: FeedPusher | None = None
        self.subscriber: EventSubscriber | None = None
        self.reports: Any = None
        self.engine: Any = None
        self._text = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="raykv-text")
        started = time.time()
        try:
            await self._start(cfg, model_dir, hash_seed)
        except BaseException:
            self.close()
            # vLLM's engine core that failed to start leaves its shared memory behind
            sweep_orphan_shared_memory(started)
            raise

    async def _start(self, cfg: RaykvConfig, model_dir: str, hash_seed: str) -> None:
        from raykv.vllm.serving import VllmEngine, cpu_platform, engine_arguments

        section = cfg.serve.vllm.model_dump()
        cpu = cpu_platform()
        if cpu:
            tp = cfg.serve.vllm.tensor_parallel_size
            self._claim = CoreClaim.claim(cfg.serve.replica_cpus * tp)
            os.environ.update(self._claim.vllm_env(tp))
        # the engine core inherits this process's environment: its block hash seed is the
        # router's (a PYTHONHASHSEED the worker was started with would make every key differ)
        if hash_seed:
            os.environ["PYTHONHASHSEED"] = hash_seed
        else:
            os.environ.pop("PYTHONHASHSEED", None)
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no telemetry leaves a replica
        events = f"ipc://{self._sockets}-kv-events"
        reports = f"ipc://{self._sockets}-load-reports"
        from raykv.vllm.load_report import LoadReports

        self.reports = LoadReports(reports) if cfg.offload.enabled else None
        layout_chunk = cfg.offload.blocks_per_chunk if cfg.offload.enabled else 1
        self.mirror = VllmKVMirror(layout_chunk)
        self.subscriber = EventSubscriber(events, self.mirror) if cfg.offload.events else None
        arguments = engine_arguments(
            model_dir,
            section,
            cfg.offload,
            events_endpoint=events if cfg.offload.events else None,
            reports_endpoint=reports if self.reports is not None else None,
            cpu_platform=cpu,
        )
        loop = asyncio.get_running_loop()
        # building the engine starts its process and loads the model: not on the loop
        self.engine = await loop.run_in_executor(None, VllmEngine, arguments)
        self.layout = KVLayout(
            self.engine.block_size,
            layout_chunk,
            (0,),
            f"vllm:{cfg.serve.vllm.prefix_caching_hash_algo}",
            hash_seed or None,
        )
        if self.replica:
            self._pusher = replica_feed(self.replica, self._collect_kv)

    def _collect_kv(self, whole: bool) -> tuple[list[WireEvent] | Snapshot, Load]:
        load = Load(self._counts.prefill_tokens, self._counts.decoding)
        if whole:
            return self.mirror.state(), load
        return self.mirror.take(), load

    # ---- requests ---------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineUpdate]:
        """The request's updates as vLLM produces them (a Serve streaming method)."""
        from raykv.vllm.serving import RequestNotServable

        if self._closed:
            yield EngineUpdate(error="the replica is shutting down", status=503)
            return
        if self.engine is None or self.engine.errored:
            self._engine_lost()
            yield EngineUpdate(error=ENGINE_STOPPED, status=503)
            return
        engine_id = f"raykv{next(self._ids)}"  # the client's id may repeat; no dash (vLLM adds)
        try:
            request.sampling.check()
            self.engine.check(len(request.token_ids), request.sampling, request.max_tokens)
        except RequestNotServable as exc:
            yield EngineUpdate(error=str(exc), status=400, param=exc.field)
            return
        except ValueError as exc:
            yield EngineUpdate(error=str(exc), status=400, param=getattr(exc, "field", None))
            return
        loop = asyncio.get_running_loop()
        text = TextStream(self.texts.decode, list(request.stop))
        counts = self._counts
        prompt = len(request.token_ids)
        # what is left to compute, as raykv's engine counts its load: the prompt less what the
        # replica's prefix cache and tiers hold of it (as its own KV events say)
        pending = self._to_compute(request)
        counts.prefill_tokens += pending
        prefilling, finished = True, False
        self._streams += 1
        try:
            stream = self.engine.generate(
                engine_id,
                list(request.token_ids),
                request.sampling,
                request.max_tokens,
                request.cache_salt,
            )
            async for delta in stream:
                if prefilling and (delta.token_ids or delta.finish_reason):
                    prefilling = False
                    counts.prefill_tokens -= pending
                    counts.decoding += 1
                update = await loop.run_in_executor(
                    self._text, self.texts.update, text, delta.token_ids, delta.logprobs
                )
                reason = delta.finish_reason
                if reason == "error":  # vLLM could not compute this request (its log says why)
                    finished = True
                    yield EngineUpdate(error=ENGINE_FAILED, status=500)
                    return
                if text.stopped:
                    await self.engine.abort(engine_id)
                    reason = "stop"
                if reason is not None:
                    update.text += await loop.run_in_executor(self._text, text.finish)
                    update.finish_reason = _finish_reason(reason)
                    await self._usage(
                        update, engine_id, prompt, len(text.tokens), delta.cached_tokens
                    )
                    finished = True
                    yield update
                    return
                if update.text or update.token_ids:
                    yield update
        except RequestNotServable as exc:
            finished = True
            yield EngineUpdate(error=str(exc), status=400, param=exc.field)
        except asyncio.CancelledError:
            raise
        except ValueError as exc:  # vLLM's own refusal of the request (its validation)
            finished = True
            yield EngineUpdate(error=f"vLLM refuses this request: {exc}", status=400)
        except Exception:
            log.exception("vLLM failed request %s", engine_id)
            finished = True
            stopped = self.engine.errored
            if stopped:
                self._engine_lost()
            yield EngineUpdate(
                error=ENGINE_STOPPED if stopped else ENGINE_FAILED, status=503 if stopped else 500
            )
        finally:
            self._streams -= 1
            if prefilling:
                counts.prefill_tokens -= pending
            else:
                counts.decoding -= 1
            if not finished:  # the client went away: vLLM stops computing for it
                with contextlib.suppress(Exception):
                    await self.engine.abort(engine_id)

    def _to_compute(self, request: EngineRequest) -> int:
        keys = PromptKeys.of(request.token_ids, self.layout, request.cache_salt)
        shared = self.mirror.kv.shared
        return prompt_hit(keys, self.mirror.kv, self.layout, shared=shared).computed_tokens

    async def _usage(
        self, update: EngineUpdate, engine_id: str, prompt: int, completion: int, cached: int
    ) -> None:
        from raykv.vllm.load_report import REPORT_WAIT_S, TierTokens

        report = None
        if self.reports is not None and cached:
            report = await self.reports.take_async(engine_id, REPORT_WAIT_S)
        tiers = TierTokens.split(cached, report)
        update.prompt_tokens = prompt
        update.completion_tokens = completion
        update.cached_tokens = cached
        update.cpu_tier_tokens = tiers.cpu
        update.disk_tier_tokens = tiers.disk
        update.shared_tier_tokens = tiers.shared

    # ---- routing and health -----------------------------------------------------------------

    def check_health(self) -> None:
        """Serve's health check: raises once vLLM's engine has died (Serve replaces this
        replica)."""
        if not self._closed and (self.engine is None or self.engine.errored):
            self._engine_lost()
            raise RuntimeError("vLLM's engine has stopped (see this replica's log)")

    def _engine_lost(self) -> None:
        """vLLM's engine died: the KV feed goes at once (routers then count this replica's KV
        as empty and its load as unknown, instead of sending it the prompts it held until Serve
        replaces it)."""
        if self._pusher is not None:
            self._pusher.end()
            self._pusher = None

    def ping(self) -> bool:
        return not self._closed and self.engine is not None and not self.engine.errored

    def info(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "node": ray.get_runtime_context().get_node_id(),
            "engine": "vllm",
            "cores": self._claim.cores if self._claim is not None else [],
            "block_size": self.engine.block_size if self.engine is not None else 0,
            "engine_core": (self.engine.engine_core_pids() or [0])[0] if self.engine else 0,
        }

    def stats(self) -> dict[str, int]:
        return {
            "rss_bytes": _resident_bytes(),
            "streams": self._streams,
            "prefill_tokens": self._counts.prefill_tokens,
            "decoding": self._counts.decoding,
            "event_batches": self.mirror.batches,
            "event_gaps": self.mirror.gaps,
            "event_errors": self.subscriber.errors if self.subscriber is not None else 0,
            "feeds_recreated": self._pusher.recreated if self._pusher is not None else 0,
        }

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._pusher is not None:
            self._pusher.end()
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.shutdown()  # its core writes what it stores through to the disk tier
        if self.subscriber is not None:
            self.subscriber.close()
        if self.reports is not None:
            self.reports.close()
        self._text.shutdown(wait=False, cancel_futures=True)
        if self._claim is not None:
            self._claim.release()


def sweep_orphan_shared_memory(
    since: float, directory: str = "/dev/shm", prefixes: tuple[str, ...] = ("psm_",)
) -> list[str]:
    """Remove the POSIX shared memory segments (``psm_*``, Python's; with ``prefixes`` also its
    semaphores, ``sem.mp-*``) made since ``since`` that no live process has open or mapped: what
    a vLLM engine core that died while starting leaves (a quarter of a GiB each here), or one
    killed with its replica. Returns what it removed."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefixes)]
    except OSError:
        return []
    candidates = []
    for name in names:
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if os.stat(path).st_mtime >= since - 1:
                candidates.append(path)
    if not candidates:
        return []
    in_use: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            in_use.update(p for p in candidates if p in maps.read())
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target in candidates:
                        in_use.add(target)
    removed = []
    for path in candidates:
        if path not in in_use:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    if removed:
        log.warning("removed %d shared memory segments a dead vLLM engine left", len(removed))
    return removed


def _finish_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "abort"
