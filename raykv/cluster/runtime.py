"""Starting or joining Ray, and leaving nothing behind of an instance raykv started."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from raykv.transfer.pool_files import process_alive

LOOPBACK = "127.0.0.1"
NAMESPACE = "raykv"


@dataclass(slots=True)
class RayHandle:
    """How this process is connected to Ray; ``started`` means raykv owns the instance."""

    address: str
    started: bool
    # where this node's Prometheus exporter answers (Ray's metrics agent; on loopback for an
    # embedded instance); None when Ray does not say
    metrics_url: str | None = None
    raylet_pid: int | None = None  # an embedded instance's raylet (its channels' semaphores)

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


def remove_channel_semaphores(pid: int, directory: Path = SEMAPHORE_DIR) -> int:
    """Once process ``pid`` has exited (waiting up to ``RAYLET_EXIT_S``), remove the channel
    semaphores named after it; returns how many. Nothing while it lives: they may be in use."""
    deadline = time.monotonic() + RAYLET_EXIT_S
    while process_alive(pid):
        if time.monotonic() >= deadline:
            return 0
        time.sleep(0.05)
    removed = 0
    for prefix in ("sem.hdr", "sem.obj"):
        for path in directory.glob(f"{prefix}{pid}-*"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
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
    an embedded instance: loopback only, no dashboard, only the CPUs asked for."""
    import ray

    if ray.is_initialized():
        return RayHandle(ray.get_runtime_context().gcs_address, started=False)
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
        return RayHandle(address, started=False)
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
        info.get("gcs_address", LOOPBACK), started=True, metrics_url=url, raylet_pid=_raylet_pid()
    )
