"""Where each run keeps its ranks' shared-memory CPU-pool shards, and who removes them.

Files are named ``raykv-<host>-<owner pid>-<token>-r<rank>g<generation>.pool`` in a tmpfs
directory (``offload.shared_pool_dir``). The owner is the process that started the run (the
``raykv run`` process or the driver); it removes them at the end, and a later run on the same
host removes files whose owner is gone (a crashed run). A new generation gives a rank a fresh
file when its predecessor could not be confirmed dead: a live process must never share memory
with its replacement. No torch here: the driver names and removes files without importing it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import secrets
import socket
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
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True
