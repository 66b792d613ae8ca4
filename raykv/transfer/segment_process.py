"""A node's segment of the shared tier's pool, given by a process of its own.

The pool's memory must not live and die with an engine: on a Ray cluster one store actor per
node holds it; an engine in one process (and the transfer bench) starts a child process that
holds it for as long as the engine runs. A process of its own also ends cleanly where the
master is gone: Mooncake's client, asked to close, retries unmounting its segment for seconds
against a dead master, where a child is simply ended.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

from raykv.transfer.shared_master import die_with_parent, spawn_from_lasting_thread
from raykv.transfer.shared_store import (
    SegmentHolder,
    SharedStoreError,
    StoreEndpoint,
    reachable,
)

START_S = 30.0  # how long the child may take to give its segment
STOP_S = 10.0  # how long a clean stop may take before the child is killed


def _hold(endpoint: StoreEndpoint, segment_bytes: int, ready: Any, stop: Any, parent: int) -> None:
    """The child's life: give the pool a segment until told to stop (or its parent dies: a
    segment never outlives the run that started it)."""
    die_with_parent(parent)
    try:
        holder = SegmentHolder(endpoint, segment_bytes)
    except SharedStoreError as exc:  # said to the parent through the queue, not a traceback
        ready.put(str(exc))
        return
    except Exception as exc:
        ready.put(f"{type(exc).__name__}: {exc}")
        return
    ready.put("")
    stop.wait()
    holder.close()


class HeldSegment:
    """``segment_bytes`` of a child process's DRAM given to the pool at ``endpoint`` while the
    context (or ``start`` .. ``stop``) lasts. ``pid``: the child's."""

    def __init__(self, endpoint: StoreEndpoint | str, segment_bytes: int) -> None:
        self.endpoint = endpoint if isinstance(endpoint, StoreEndpoint) else StoreEndpoint(endpoint)
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._ready = ctx.Queue()
        self._stop = ctx.Event()
        self._process = ctx.Process(
            target=_hold,
            args=(self.endpoint, segment_bytes, self._ready, self._stop, os.getpid()),
            daemon=True,
            name="raykv-shared-segment",
        )

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def start(self) -> None:
        """Start the child and wait until its segment is given (``SharedStoreError`` naming
        what went wrong)."""
        # from a thread that lasts: the child dies with the thread that started it
        spawn_from_lasting_thread(self._process.start)
        try:
            problem = self._ready.get(timeout=START_S)
        except Exception:
            problem = f"no segment given within {START_S:g} s"
        if problem:
            self.stop()
            raise SharedStoreError(problem)

    def kill(self) -> None:
        """End the child at once (a fault: the segment is gone, with what it held)."""
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)

    def stop(self) -> None:
        """Take the segment back (a clean unmount where the master answers; the child ended
        at once where it does not) and end the child."""
        if self._process.pid is None:
            return
        if self._process.is_alive() and reachable(self.endpoint.master, 0.5):
            self._stop.set()
            self._process.join(STOP_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._ready.close()

    def __enter__(self) -> HeldSegment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
