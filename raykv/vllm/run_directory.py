"""An engine's private run directory: ``$TMPDIR/raykv-<uid>/vllm-<engine id>/``, where its
workers name bad chunks to its manager and its processes find an embedded master.

Every process of the engine holds a shared lock on the directory's ``lock`` file while it lives
(the kernel lets go of it when the process ends, however it ends), so an engine that starts
removes the directories no live engine holds: those left by an engine killed before its
shutdown (``vllm serve`` ended by a signal) do not pile up.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time

from raykv.transfer.disk_files import private_directory

LOCK = "lock"
PREFIX = "vllm-"
YOUNG_S = 60.0  # a directory whose lock is newer may be one a process is setting up now

_held: dict[str, int] = {}  # this process's locks, by directory: kept open while it lives


def engine_run_directory(engine_id: str) -> str:
    """The engine's run directory (made 0700 where missing), held by this process; stale
    siblings removed. The first live process of the engine clears what a dead engine of the
    same id left there (vLLM's engine id may be set by the user)."""
    base = os.path.join(tempfile.gettempdir(), f"raykv-{os.getuid()}")
    path = os.path.join(base, f"{PREFIX}{engine_id}")
    private_directory(base)
    if path not in _held:
        _held[path] = _hold(path)
    sweep(base, keep=path)
    return path


def _hold(path: str, tries: int = 5) -> int:
    lock = os.path.join(path, LOCK)
    for _ in range(tries):
        private_directory(path)
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            first = True
        except OSError:
            first = False
            fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # a sweep removed it between our open and our lock: make it again
            os.close(fd)
            continue
        os.utime(lock)  # young: no sweep takes it while this engine's processes set up
        if first:
            _clear(path)
            fcntl.flock(fd, fcntl.LOCK_SH)
        return fd
    raise OSError(f"cannot hold the engine's run directory {path}")


def _clear(path: str) -> None:
    for entry in os.listdir(path):
        if entry != LOCK:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(path, entry))


def sweep(base: str, keep: str) -> int:
    """Remove ``base``'s run directories no live process holds (not ``keep``); how many."""
    removed = 0
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    for name in names:
        path = os.path.join(base, name)
        if not name.startswith(PREFIX) or path == keep or os.path.islink(path):
            continue
        lock = os.path.join(path, LOCK)
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # none yet (being made), or not a run directory of this release
        try:
            if time.time() - os.fstat(fd).st_mtime < YOUNG_S:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live engine's
            _clear(path)
            with contextlib.suppress(OSError):
                os.unlink(lock)
                os.rmdir(path)
                removed += 1
        finally:
            os.close(fd)
    return removed


def release(path: str) -> None:
    """This process is done with the directory (its lock let go)."""
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)
