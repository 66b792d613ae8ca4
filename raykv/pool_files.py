"""Where each run keeps its ranks' shared-memory CPU-pool shards, and who removes them.

Files are named ``raykv-<host>-<owner pid>-<token>-r<rank>g<generation>.pool`` in a tmpfs
directory (``offload.shared_pool_dir``). The owner is the process that started the run (the
``raykv run`` process or the driver); it removes them at the end, and a later run on the same
host removes files whose owner is gone (a crashed run). A replacement rank maps its
predecessor's file once that process has exited; a new generation gives it a fresh file when
the predecessor is still alive: a live process must never share memory with its replacement.
No torch here: the driver names and removes files without importing it.
"""

from __future__ import annotations

import contextlib
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
    while not visible or _alive(pid):
        if not visible or time.monotonic() >= deadline:
            m = re.search(r"g(\d+)\.pool$", path)
            if m is None:
                raise ValueError(f"not a shard file name: {path!r}")
            return f"{path[: m.start()]}g{int(m[1]) + 1}.pool"
        time.sleep(0.02)
    return path


def sweep_stale(directory: str) -> list[str]:
    """Delete shard files left by runs on this host whose owner process is gone."""
    host, removed = socket.gethostname(), []
    for path in glob.glob(os.path.join(directory, "raykv-*.pool")):
        m = _NAME_RE.match(os.path.basename(path))
        if m is None or m["host"] != host or _alive(int(m["pid"])):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
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
