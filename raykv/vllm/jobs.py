"""What the manager hands a worker for one job: the chunks, their CPU slots, and what the tiers
below the CPU tier (disk, shared) must do (plain data; vLLM carries it from the scheduler process to
every worker process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import LoadStoreSpec


@dataclass(slots=True)
class ChunkStore(LoadStoreSpec):
    """A store: each chunk's pages into its CPU slot; then, for the chunks in ``to_disk``
    (positions in ``keys``), the slot written to the chunk's file, and for those in
    ``to_shared``, the slot put into the store (both at once). ``disk_drops``: files the disk
    tier gave up, deleted before anything is written."""

    keys: list[int]
    slots: list[int]
    to_disk: list[int] = field(default_factory=list)
    to_shared: list[int] = field(default_factory=list)
    disk_drops: list[int] = field(default_factory=list)
    check_sums: bool = False
    epoch: int = 0  # the namespace epoch it was made in: its writes go to that one's tiers only


@dataclass(slots=True)
class ChunkLoad(LoadStoreSpec):
    """A load: the chunks in ``from_disk`` (positions in ``keys``) read from their files and
    those in ``from_shared`` from the store into their CPU slots first (promotions, both at
    once), then every chunk's pages copied from its slot to the GPU blocks. ``refused``: no
    room could be made for a promotion; the job fails (vLLM then recomputes its tokens)."""

    keys: list[int]
    slots: list[int]
    from_disk: list[int] = field(default_factory=list)
    from_shared: list[int] = field(default_factory=list)
    check_sums: bool = False
    refused: bool = False
    epoch: int = 0  # the namespace epoch it was made in: it promotes from that one's tiers only
