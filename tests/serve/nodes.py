"""More Ray nodes on this machine for the multi-node tests: each a raylet of its own (with its
object store and workers) joined to the session's Ray, as ``ray.cluster_utils.Cluster`` adds
them, and removed with every process it started."""

from __future__ import annotations

import time
from typing import Any

import ray

from raykv.cluster.runtime import LOOPBACK

NODE_UP_S = 60.0


def add_node(num_cpus: int, resources: dict[str, float]) -> Any:
    """A worker node with these CPUs and custom resources, once the cluster lists it alive."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params = RayParams(
        gcs_address=ray.get_runtime_context().gcs_address,
        node_ip_address=LOOPBACK,
        num_cpus=num_cpus,
        num_gpus=0,
        resources=resources,
        object_store_memory=150 * 1024 * 1024,
        min_worker_port=0,
        max_worker_port=0,
        include_log_monitor=False,
        node_manager_port=0,
    )
    params.dashboard_agent_listen_port = None
    node = Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
    deadline = time.monotonic() + NODE_UP_S
    while not any(n["Alive"] and n["NodeID"] == node.node_id for n in ray.nodes()):
        if time.monotonic() > deadline:
            remove_node(node)
            raise TimeoutError(f"node {node.node_id} did not join within {NODE_UP_S} s")
        time.sleep(0.2)
    return node


def remove_node(node: Any) -> None:
    """Every process of the node, waited for."""
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
    deadline = time.monotonic() + NODE_UP_S
    while any(n["Alive"] and n["NodeID"] == node.node_id for n in ray.nodes()):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
