"""Ray Serve's replica gRPC server on the node's address, not on every interface.

Ray Serve 2.60 starts an inter-deployment gRPC server in every replica bound to ``[::]:0``, in
its own code (``ray/serve/_private/replica.py``), with no option to bind it elsewhere. Before
that server starts (after the deployment's constructor has run), raykv's deployments have the
replica's module bind it to this node's address instead: the address Ray gives the node
(loopback for an embedded Ray, the node's cluster address on a cluster), which is where other
replicas reach it. Where Serve's code is not as expected, nothing is changed (and the listener
tests fail).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import ray

log = logging.getLogger(__name__)

WILDCARD = "[::]:"


def bind_replica_grpc_to_node() -> bool:
    """In a Serve replica's process: have its inter-deployment gRPC server listen on this
    node's address. Whether Serve's code could be told so."""
    try:
        from ray.serve._private import replica
    except ImportError:
        return False
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None:
        log.warning("Ray Serve's replica gRPC server listens on every interface (no hook found)")
        return False
    if getattr(original, "_raykv_node_bound", False):
        return True
    host = ray.util.get_node_ip_address()
    bracketed = f"[{host}]" if ":" in host else host

    @functools.wraps(original)
    def on_node(server: Any, address: str) -> int:
        if address.startswith(WILDCARD):
            address = f"{bracketed}:{address[len(WILDCARD) :]}"
        return original(server, address)

    on_node._raykv_node_bound = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = on_node
    return True
