"""Where each run keeps its ranks' shared-memory CPU-pool shards, and who removes them.

Files are named ``raykv-<host>-<owner pid>-<token>-r<rank>g<generation>.pool`` in a tmpfs
directory (``offload.shared_pool_dir``) on the node where the rank runs. The owner is the
process that started the run (the ``raykv run`` process or the driver), on ``<host>``, which
may be another node. A replacement rank maps its predecessor's file once that process has
exited; a new generation gives it a fresh file when the predecessor is still alive: a live
process must never share memory with its replacement.

Clean-up: a rank removes its own file when it shuts down and the owner removes what is left on
its host at the end. Files of crashed runs are swept (:func:`sweep_stale`) on every node: each
rank sweeps its node's directory when it starts (and the driver its own host). A rank holds a
shared ``flock`` on its file while it lives (:func:`hold`), which its death releases; a sweep
removes a file only when it can take the lock exclusively (no live rank holds it) and, where the
owner can be seen (same host), the owner is gone too. A rank never sweeps its own run's files:
a dead rank's shard waits for its successor. A sweep by another run in the moment between a
rank's death and its successor's start may still remove that shard: the successor then starts
a fresh one and the CPU tier is emptied, as when the shard cannot be kept (never stale bytes).
No torch here: the driver names and removes files without importing it.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass

_NAME_RE = re.compile(r"^raykv-(?P<host>.+)-(?P<pid>\d+)-(?P<token>[0-9a-f]+)-r\d+g\d+\.pool$")


@dataclass(frozen=True, slots=True)
class PoolFiles:
    """Where one run keeps its ranks' CPU-pool shards."""

    directory: str
    owner: str  # "<host>-<pid>-<token>", unique per run

    @classmethod
    def new(cls, directory: str) -> PoolFiles:
        """A namespace for a new run, owned by this process."""
        return cls(directory, f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(6)}")

    def path(self, rank: int, generation: int = 0) -> str:
        return os.path.join(self.directory, f"raykv-{self.owner}-r{rank}g{generation}.pool")

    def remove(self) -> int:
        """Delete every shard file of this run on this host (those of dead ranks included)."""
        removed = 0
        for path in glob.glob(os.path.join(self.directory, f"raykv-{self.owner}-r*.pool")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed += 1
        return removed


def remove_generations(path: str, keep: bool = False) -> None:
    """Delete every generation of this rank's shard, ``path`` itself unless ``keep``: a rank
    given a new generation removes the files of predecessors that were killed rather than
    crashed (their memory is freed once their processes are gone), and a rank shutting down
    removes its own."""
    stem = re.sub(r"g\d+\.pool$", "g", path)
    for other in glob.glob(glob.escape(stem) + "*.pool"):
        if keep and other == path:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(other)


def process_id() -> tuple[int, int | None]:
    """This process's pid and its pid namespace (None where /proc cannot tell): a pid means
    the same process only within one namespace."""
    try:
        ns: int | None = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = None
    return os.getpid(), ns


def successor_path(path: str, predecessor: tuple[int, int | None], wait_s: float) -> str:
    """The shard file for a rank that replaces the process ``predecessor`` (``process_id()``
    there): ``path`` itself once that process is gone, waiting up to ``wait_s`` for it to exit
    (a rank killed with ``ray.kill`` can run on for a moment); the next generation's fresh file
    if it is still alive then, or if it cannot be seen from here (another pid namespace), so
    that two live processes never share a shard."""
    pid, ns = predecessor
    visible = ns is not None and ns == process_id()[1]
    deadline = time.monotonic() + wait_s
    while not visible or process_alive(pid):
        if not visible or time.monotonic() >= deadline:
            m = re.search(r"g(\d+)\.pool$", path)
            if m is None:
                raise ValueError(f"not a shard file name: {path!r}")
            return f"{path[: m.start()]}g{int(m[1]) + 1}.pool"
        time.sleep(0.02)
    return path


def owner_of(path: str) -> str | None:
    """The run owner (``PoolFiles.owner``) a shard file's name carries; None if not one."""
    m = _NAME_RE.match(os.path.basename(path))
    return None if m is None else f"{m['host']}-{m['pid']}-{m['token']}"


def hold(path: str) -> int | None:
    """Hold a shared lock on the shard file ``path`` (created empty if missing) until the
    returned descriptor is closed or this process ends, however it ends: while any process
    holds one, :func:`sweep_stale` leaves the file alone. None when the file cannot be opened
    (no such directory: the rank keeps its shard in private memory)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a sweep is removing this file
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # a sweep removed the file between the open and the lock: again


def sweep_stale(directory: str, keep_owner: str | None = None) -> list[str]:
    """Delete shard files in ``directory`` (on this node) left by crashed runs: files no live
    process holds (:func:`hold`) whose owner, when it ran on this host, is gone too. The files
    of run ``keep_owner`` (the sweeping rank's own) are never touched."""
    host, removed = socket.gethostname(), []
    for path in glob.glob(os.path.join(directory, "raykv-*.pool")):
        m = _NAME_RE.match(os.path.basename(path))
        if m is None or owner_of(path) == keep_owner:
            continue
        if m["host"] == host and process_alive(int(m["pid"])):
            continue  # its run is alive
        if _remove_unheld(path):
            removed.append(path)
    return removed


def _remove_unheld(path: str) -> bool:
    """Unlink ``path`` if no process holds it (an exclusive lock can be taken now)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # gone already, or someone else's file
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path).st_ino != os.fstat(fd).st_ino:
            return False  # replaced meanwhile: not the file that was free
        os.unlink(path)
        return True
    except OSError:  # held by a live rank (BlockingIOError), or removed meanwhile
        return False
    finally:
        os.close(fd)


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie has let go of its memory already)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True  # no /proc: existence is all we can tell
