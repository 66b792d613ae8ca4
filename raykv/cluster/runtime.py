"""Starting or joining Ray."""

from __future__ import annotations

import os
from dataclasses import dataclass

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

    def shutdown(self) -> None:
        import ray

        if self.started and ray.is_initialized():
            ray.shutdown()


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
    return RayHandle(info.get("gcs_address", LOOPBACK), started=True, metrics_url=url)
