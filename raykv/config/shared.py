"""The shared tier's section (``offload.shared``): the cluster-wide tier on Mooncake Store, where
its master is, how much DRAM this node gives the pool, and how chunks reach it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from raykv.config.base import ByteSize, _Strict

EMBEDDED = "embedded"


def check_address(value: str) -> str:
    """``embedded`` or ``host:port`` (a port in 1..65535)."""
    if value == EMBEDDED:
        return value
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("neither 'embedded' nor host:port")
    return value


class SharedTierConfig(_Strict):
    """A tier every engine of the cluster reads and writes: each rank puts its part of a chunk
    into Mooncake Store under the chunk's namespaced key and reads what any engine put there.
    The pool's memory belongs to one store actor per node, not to an engine, so a replica's
    restart or scale-down loses nothing of it."""

    enabled: bool = Field(default=False, description="Use the shared tier (Mooncake Store).")
    master: str = Field(
        default=EMBEDDED,
        description="host:port of a running mooncake_master, or embedded: raykv starts one for "
        "the run on loopback on a free port and stops it at the end.",
    )
    segment: ByteSize = Field(
        default=2**30,
        gt=0,
        description="Bytes of DRAM this node gives the pool (mounted by the node's store actor).",
    )
    mount: bool = Field(
        default=True,
        description="raykv gives this node's segment (its store actor on Ray; a process of its "
        "own for an engine in one process). false: the pool's memory is given by others (a "
        "Mooncake store service the operator runs, or another raykv process); segment then only "
        "sizes this engine's index of the store.",
    )
    publish: Literal["through", "back"] = Field(
        default="through",
        description="When a chunk is put into the store: through, as the CPU tier stores it "
        "(every replica can load it from then on); back, as it leaves the CPU tier (fewer "
        "puts; what a replica still holds in DRAM is not shared, and goes with the replica). "
        "With a disk tier, back publishes what its demotions give up; without one (or while "
        "the disk takes none) it keeps offload.disk.reserve_fraction of the CPU tier free by "
        "publishing its coldest chunks ahead of need.",
    )
    protocol: Literal["tcp", "rdma"] = Field(
        default="tcp", description="How the store moves bytes: tcp, or rdma where the NICs have it."
    )
    devices: str = Field(
        default="",
        description="RDMA devices (e.g. mlx5_0,mlx5_1); empty: found by Mooncake (rdma only).",
    )
    timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Seconds an engine waits for the master to answer when it joins the store "
        "(a master nothing answers for is refused by name; Mooncake's own calls then fail "
        "after its timeouts, seconds each, and the tier pauses).",
    )
    retry_steps: int = Field(
        default=512,
        gt=0,
        description="Steps the tier stays out of use after its operations kept failing (the "
        "master unreachable), before it is tried again.",
    )

    @field_validator("master")
    @classmethod
    def _master(cls, value: str) -> str:
        return check_address(value)
