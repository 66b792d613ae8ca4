"""Starting or joining Ray, and leaving nothing behind of an instance raykv started."""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from raykv.transfer.pool_files import process_alive

LOOPBACK = "127.0.0.1"
NAMESPACE = "raykv"

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RayHandle:
    """How this process is connected to Ray; ``started`` means raykv owns the instance."""

    address: str
    started: bool
    # where this node's Prometheus exporter answers (Ray's metrics agent; on loopback for an
    # embedded instance); None when Ray does not say
    metrics_url: str | None = None
    raylet_pid: int | None = None  # an embedded instance's raylet (its channels' semaphores)
    swept_semaphores: int = 0  # crashed runs' channel semaphores removed when it started

    def shutdown(self) -> None:
        import ray

        if self.started and ray.is_initialized():
            ray.shutdown()
            if self.raylet_pid is not None:
                remove_channel_semaphores(self.raylet_pid)


# Ray's compiled-graph channels each open two POSIX semaphores, named after the process that
# set the channel up (the raylet, whose object store holds it): /dev/shm/sem.hdr<pid>-* and
# sem.obj<pid>-*. Only that process's clean exit unlinks them, and ray.shutdown kills it, so
# every embedded instance that ran a graph would leave them behind, a few per channel.
SEMAPHORE_DIR = Path("/dev/shm")
RAYLET_EXIT_S = 10.0
# Ray names a channel <pid>-<nanoseconds since the epoch>; sem_open adds the "sem." prefix.
# Nothing that merely resembles it is ever ours to remove.
_SEMAPHORE_NAME = re.compile(r"sem\.(?:hdr|obj)(?P<pid>[1-9][0-9]*)-[0-9]+")


def _channel_semaphores(directory: Path) -> Iterator[tuple[Path, int]]:
    """Every channel semaphore in ``directory``, with the pid it is named after."""
    try:
        entries = list(os.scandir(directory))
    except OSError:  # no such directory (not Linux): nothing was left there
        return
    for entry in entries:
        match = _SEMAPHORE_NAME.fullmatch(entry.name)
        if match is not None:
            yield Path(entry.path), int(match["pid"])


def _unlink_semaphore(path: Path) -> bool:
    """Remove one semaphore file; False when it is not a plain file, is gone already (another
    sweep), or is another user's (/dev/shm is sticky)."""
    try:
        if not stat.S_ISREG(path.lstat().st_mode):
            return False
        path.unlink()
    except OSError:
        return False
    return True


def remove_channel_semaphores(pid: int, directory: Path = SEMAPHORE_DIR) -> int:
    """Once process ``pid`` has exited (waiting up to ``RAYLET_EXIT_S``), remove the channel
    semaphores named after it; returns how many. Nothing while it lives: they may be in use."""
    deadline = time.monotonic() + RAYLET_EXIT_S
    while process_alive(pid):
        if time.monotonic() >= deadline:
            return 0
        time.sleep(0.05)
    return sum(
        _unlink_semaphore(path) for path, owner in _channel_semaphores(directory) if owner == pid
    )


def sweep_channel_semaphores(directory: Path | None = None) -> int:
    """Remove the channel semaphores left by runs that crashed: those named after a process
    that no longer runs (a SIGKILLed run's raylet never unlinks them, and its shutdown never
    came). Never one of a live process, whose channels may be in use; returns how many.

    ``directory``: where they are (``SEMAPHORE_DIR``, looked up when called)."""
    directory = SEMAPHORE_DIR if directory is None else directory
    # a pid recycled by an unrelated live process keeps its files: the sweep errs towards
    # leaving litter, never towards removing a semaphore in use. (A pid is only meaningful
    # in this pid namespace: a container that shares /dev/shm but not its pids with another
    # would see the other's live raylets as gone.)
    alive: dict[int, bool] = {}
    removed = 0
    for path, pid in _channel_semaphores(directory):
        if pid not in alive:
            alive[pid] = process_alive(pid)
        if not alive[pid] and _unlink_semaphore(path):
            removed += 1
    if removed:
        log.info(
            "removed %d compiled-graph semaphores of exited Ray instances from %s",
            removed,
            directory,
        )
    return removed


def _raylet_pid() -> int | None:
    """This driver's raylet, when this process started it (Ray keeps no public handle)."""
    try:
        from ray._private import ray_constants, worker

        node = worker._global_node
        return node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    except Exception:
        return None


def connect(
    address: str | None = None, num_cpus: int = 2, num_gpus: int | None = None
) -> RayHandle:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``, as under ``ray job submit``), or start
    an embedded instance: loopback only, no dashboard, only the CPUs asked for, after sweeping
    the channel semaphores crashed runs left on this host (:func:`sweep_channel_semaphores`)."""
    import ray

    if ray.is_initialized():
        return RayHandle(ray.get_runtime_context().gcs_address, started=False)
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
        return RayHandle(address, started=False)
    # before the new raylet exists: it could be handed a crashed run's pid, and its files would
    # then look alive for as long as it runs
    swept = sweep_channel_semaphores()
    ctx = ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        _node_ip_address=LOOPBACK,
        namespace=NAMESPACE,
        log_to_driver=True,
    )
    info = ctx.address_info
    port = info.get("metrics_export_port")
    url = f"http://{LOOPBACK}:{port}/metrics" if port else None
    return RayHandle(
        info.get("gcs_address", LOOPBACK),
        started=True,
        metrics_url=url,
        raylet_pid=_raylet_pid(),
        swept_semaphores=swept,
    )
