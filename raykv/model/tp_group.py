"""The tensor-parallel group of a real model's ranks: a ``torch.distributed`` process group
(gloo on CPUs, NCCL on CUDA) and the all-reduce the decoder calls.

Rendezvous goes through a ``TCPStore`` that rank 0 serves on its node's address and on a port
the operating system picks at start (no fixed port). The store listens on that address only
(loopback under the embedded Ray), and so do gloo's connections between the ranks. Every
collective is bounded by a timeout: a rank whose peer died or hangs gets ``CollectiveFailed``
instead of waiting for good, and leaves the group so that the whole group is rebuilt.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raykv.faults import RankDied


class CollectiveFailed(RankDied):
    """A collective did not complete (a peer died, or stayed silent past the timeout): this
    rank's process group is broken, so the rank is as good as dead."""


@dataclass(slots=True)
class RendezvousAddress:
    """Where the ranks of one TP group meet."""

    host: str
    port: int


class Rendezvous:
    """The store the ranks meet at, served by rank 0 for as long as its group lives."""

    def __init__(self, host: str, timeout_s: float) -> None:
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        listener.bind((host, 0))
        listener.listen(64)
        self.address = RendezvousAddress(host, listener.getsockname()[1])
        # the store takes the bound socket over (a store binding its own would listen on every
        # interface); the libuv server cannot take a socket, the classic one can
        self._store = dist.TCPStore(
            host,
            self.address.port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=listener.detach(),
            use_libuv=False,
        )


class TPGroup:
    """This rank's membership of its TP group; ``all_reduce`` sums a tensor over the group."""

    def __init__(
        self,
        address: RendezvousAddress,
        rank: int,
        world_size: int,
        *,
        device: str,
        host: str,
        timeout_s: float,
    ) -> None:
        """``host``: this rank's own address (gloo listens on it for its peers)."""
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(
                address.host, address.port, is_master=False, timeout=timeout, use_libuv=False
            )
            prefixed = dist.PrefixStore("raykv-tp", store)
            self._cuda = device == "cuda"
            if self._cuda:
                dist.init_process_group(
                    "nccl", store=prefixed, rank=rank, world_size=world_size, timeout=timeout
                )
                self._group: Any = None
            else:
                options = dist.ProcessGroupGloo._Options()
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
                options._timeout = timeout
                self._group = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        except (RuntimeError, dist.DistError) as exc:
            raise CollectiveFailed(
                f"rank {rank} could not join its TP group at {address.host}:{address.port}: {exc}"
            ) from exc
        self._store = store  # the group talks through it until it closes

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place; returns it."""
        try:
            if self._cuda:
                dist.all_reduce(tensor)
            else:
                self._group.allreduce([tensor]).wait()
        except (RuntimeError, dist.DistError) as exc:
            raise CollectiveFailed(f"rank {self.rank}: all-reduce failed: {exc}") from exc
        return tensor

    def close(self) -> None:
        if self._cuda and dist.is_initialized():
            dist.destroy_process_group()
        self._group = None
