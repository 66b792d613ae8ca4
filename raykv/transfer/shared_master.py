"""The shared tier's master for one run (``offload.shared.master: embedded``): Mooncake's
``mooncake_master`` started on loopback on free ports, and stopped (by its pid) at the end, as
raykv does for an embedded Ray.

Its RPC port is where clients join (``StoreEndpoint.master``); clients exchange their transfer
metadata directly (``P2PHANDSHAKE``), so no metadata server runs. The master's log goes to a
file of its own in the temporary directory, or in the directory its owner names (an engine's run
directory inside vLLM, swept with it when the engine was killed); it is named in the error if
the master fails to start.

A master or a segment process must not outlive the run that started it, and the kernel ends
such a child when its parent dies (``die_with_parent``). That parent is the *thread* that
started it, not the process: a child started from a thread that ended (vLLM's engine starts its
tiers from whichever thread builds them) was killed with that thread. So every such child is
started from one thread of the process's own that lives as long as the process
(``spawn_from_lasting_thread``)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from raykv.transfer.shared_store import SharedStoreError, mooncake_problem

log = logging.getLogger(__name__)

BINARY = "mooncake_master"
PR_SET_PDEATHSIG = 1  # Linux prctl: the signal this process gets when its parent dies
T = TypeVar("T")


class _LastingThread:
    """One daemon thread that runs what it is given, in turn, until the process ends."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue[tuple[Callable[[], Any], dict[str, Any], Any]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, work: Callable[[], T]) -> T:
        """``work()`` on the thread (its result, or what it raised, here)."""
        with self._lock:  # a forked child has none: it starts its own
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="raykv-child-starter", daemon=True
                )
                self._thread.start()
        if threading.current_thread() is self._thread:
            return work()
        done = threading.Event()
        box: dict[str, Any] = {}
        self._work.put((work, box, done))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _loop(self) -> None:
        while True:
            work, box, done = self._work.get()
            try:
                box["value"] = work()
            except BaseException as exc:  # handed to the caller
                box["error"] = exc
            finally:
                done.set()


_lasting = _LastingThread()


def spawn_from_lasting_thread(start: Callable[[], T]) -> T:
    """``start()`` (which starts a child that must die with this process) from a thread that
    lives as long as the process: the kernel's parent-death signal follows the thread that
    forked, not the process."""
    return _lasting.run(start)


def master_binary() -> str:
    """The ``mooncake_master`` executable: beside this Python (a virtual environment's bin/,
    not always on PATH), on PATH, or inside the mooncake package."""
    beside = os.path.join(os.path.dirname(sys.executable), BINARY)
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which(BINARY)
    if found:
        return found
    problem = mooncake_problem()
    if problem:
        raise SharedStoreError(problem)
    import mooncake

    inside = os.path.join(os.path.dirname(mooncake.__file__), BINARY)
    if os.access(inside, os.X_OK):
        return inside
    raise SharedStoreError(f"{BINARY} not found beside {sys.executable}, on PATH or in mooncake")


def die_with_parent(parent: int | None = None) -> None:
    """In a child before it runs its work: the kernel kills it when its parent dies, so a master
    or a segment never outlives the run that started it (a crash, a test run killed at its
    limit). ``parent``: the pid it was started by; where that one is already gone (it died
    before the request took effect), the child ends at once."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EmbeddedMaster:
    """A ``mooncake_master`` of this process's own on ``host`` (loopback by default).
    ``lease_ms``: how long an object read stays safe from eviction."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        lease_ms: int = 5000,
        start_timeout_s: float = 15.0,
        log_dir: str | None = None,
    ) -> None:
        """``log_dir``: where its log goes (None: the temporary directory)."""
        self.host = host
        self.log_dir = log_dir
        self.lease_ms = lease_ms
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.log_path = ""
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """host:port of its RPC (where clients join)."""
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def alive(self) -> bool:
        """Its process runs."""
        return self._process is not None and self._process.poll() is None

    def start(self, port: int | None = None) -> str:
        """Start it (on ``port``, else a free one) and wait until it accepts connections: its
        address."""
        if self._process is not None:
            return self.address
        binary = master_binary()
        self.port = port or free_port(self.host)
        fd, self.log_path = tempfile.mkstemp(
            prefix="raykv-mooncake-master-", suffix=".log", dir=self.log_dir
        )
        args = [
            binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_port={free_port(self.host)}",  # never the fixed default another holds
            f"--metrics_host={self.host}",  # else its HTTP metrics server takes every interface
            "--enable_metric_reporting=false",
            f"--default_kv_lease_ttl={self.lease_ms}",
        ]
        with os.fdopen(fd, "wb") as log:
            self._process = spawn_from_lasting_thread(
                lambda: subprocess.Popen(
                    args,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=functools.partial(die_with_parent, os.getpid()),
                )
            )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                self._process = None
                raise SharedStoreError(
                    f"{BINARY} exited with status {code} at start (log: {self.log_path})"
                )
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.host, self.port), timeout=0.2),
            ):
                return self.address
            time.sleep(0.05)
        self.stop()
        raise SharedStoreError(
            f"{BINARY} did not listen on {self.address} within {self.start_timeout_s:g} s "
            f"(log: {self.log_path})"
        )

    def kill(self) -> None:
        """End it at once (a fault: the master dies mid-run)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(10)

    def restart(self) -> str:
        """Start it again on its port after its process died (as a supervisor would): its
        clients find it where they left it, the store empty. Its address. The dead one's log
        is kept where it was not killed (the only account of why it ended)."""
        if self.alive():
            return self.address
        if not self.port:
            raise SharedStoreError(f"{BINARY} was never started: there is no port to start again")
        process, self._process = self._process, None
        if process is not None and self.log_path:
            if process.returncode == -signal.SIGKILL:
                with contextlib.suppress(OSError):
                    os.unlink(self.log_path)
            else:
                log.warning(
                    "%s at %s ended with status %s (its log: %s); starting it again",
                    BINARY,
                    self.address,
                    process.returncode,
                    self.log_path,
                )
        return self.start(self.port)

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 5 s) and remove its log."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        if self.log_path:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)

    def __enter__(self) -> EmbeddedMaster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
