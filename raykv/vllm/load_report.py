"""Where each request's prompt tokens came from, from raykv's manager inside vLLM to the
process that serves the request (a ``raykv serve --engine vllm`` replica).

vLLM's request output carries one count of cached prompt tokens (its GPU prefix cache and the
connector's together); OpenAI's ``usage.prompt_tokens_details`` as raykv reports it splits the
connector's part per tier. Only the manager knows that split, and it runs in vLLM's engine
core, a process of its own. So the manager pushes one small message per completed load over a
loopback ZeroMQ socket (``kv_connector_extra_config["raykv_load_reports"]``), and the replica
keeps them by request until its request ends. The push never blocks the scheduler: a report
that cannot be sent at once is dropped (the replica then counts that request's cached tokens as
vLLM's prefix cache's).

A request's report is sent when its load completes, at least one forward pass before its first
token leaves the engine core; a request that loaded nothing gets an empty one when it finishes.
The replica waits for a missing report a few milliseconds at most, off its event loop. The first
chunk of a load counts whole: where vLLM's prefix cache ended inside it (``blocks_per_chunk`` above
1) the split gives the overlap to the tiers, cut from the CPU tier's count first.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import zmq

# the extra config key naming the socket
REPORTS_KEY = "raykv_load_reports"
# reports a replica keeps at most (a request that never ends would otherwise hold one)
MAX_KEPT = 65536
# how long a replica waits for a report it has reason to expect (a cached prompt) at the end
REPORT_WAIT_S = 0.05


class LoadReport(msgspec.Struct, array_like=True, frozen=True):
    """A completed load of one request: prompt tokens from each tier (``ok`` False: it failed
    and vLLM recomputes them)."""

    request_id: str
    cpu_tokens: int
    disk_tokens: int
    shared_tokens: int
    ok: bool = True


@dataclass(slots=True, frozen=True)
class TierTokens:
    """A request's cached prompt tokens per place: vLLM's GPU prefix cache and raykv's tiers."""

    gpu: int = 0
    cpu: int = 0
    disk: int = 0
    shared: int = 0

    @classmethod
    def split(cls, cached: int, report: LoadReport | None) -> TierTokens:
        """``cached`` (vLLM's count) split by ``report``: the tiers' part is what the report
        says, cut to ``cached`` from the CPU tier down (a chunk that overlapped the GPU hit);
        the rest is the GPU's."""
        if report is None or not report.ok:
            return cls(gpu=cached)
        parts = [report.cpu_tokens, report.disk_tokens, report.shared_tokens]
        excess = sum(parts) - cached
        for i in range(3):
            cut = min(max(excess, 0), parts[i])
            parts[i] -= cut
            excess -= cut
        return cls(cached - sum(parts), *parts)


class LoadReporter:
    """The manager's side: a PUSH socket connected to the replica's endpoint."""

    def __init__(self, endpoint: str) -> None:
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, 4096)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._encode = msgspec.msgpack.Encoder().encode
        self.dropped = 0

    def report(self, report: LoadReport) -> None:
        try:
            self._socket.send(self._encode(report), zmq.NOBLOCK)
        except zmq.ZMQError:  # nobody reads, or too far behind: the split is lost, not a step
            self.dropped += 1

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._socket.close(linger=0)


class LoadReports:
    """The replica's side: a PULL socket bound on ``endpoint`` (an ``ipc://`` path of the
    replica's own) read by a thread, reports kept by request id until taken."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._decode = msgspec.msgpack.Decoder(LoadReport).decode
        self._kept: OrderedDict[str, LoadReport] = OrderedDict()
        self._arrived = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raykv-load-reports", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            try:
                report = self._decode(self._socket.recv(zmq.NOBLOCK))
            except (zmq.ZMQError, msgspec.DecodeError):
                continue
            # vLLM names a request by the id it was given and a dash with 8 characters of its
            # own; the replica's ids have no dash
            head, dash, _ = report.request_id.rpartition("-")
            key = head if dash else report.request_id
            with self._arrived:
                if not report.ok or key not in self._kept:  # a load's split stays (its end's
                    self._kept[key] = report  # empty report comes after it)
                while len(self._kept) > MAX_KEPT:
                    self._kept.popitem(last=False)
                self._arrived.notify_all()

    async def take_async(self, request_id: str, wait_s: float) -> LoadReport | None:
        """``take`` without holding the caller's event loop: at once when the report is here,
        else waiting in a thread."""
        with self._arrived:
            if request_id in self._kept:
                return self._kept.pop(request_id)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.take, request_id, wait_s)

    def take(self, request_id: str, wait_s: float = 0.0) -> LoadReport | None:
        """The report of ``request_id`` (forgotten here), waiting up to ``wait_s`` for it."""
        deadline = time.monotonic() + wait_s
        with self._arrived:
            while request_id not in self._kept:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._arrived.wait(left)
            return self._kept.pop(request_id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with contextlib.suppress(zmq.ZMQError):
            self._socket.close(linger=0)
