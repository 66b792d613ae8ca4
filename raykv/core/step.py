"""The step message: what the scheduler sends to every rank each step, and what each rank sends
back. Each has a transfer part (the connector's: jobs to flush, load and store; their acks) and
a model part (the batch to compute; the sampled results).

Plain data: ints and lists in msgspec records (slotted like ``dataclass(slots=True)``), cheap to
build, to check in tests, and to encode for Ray as MessagePack arrays (``cluster/wire.py``).
Ranks see job ids, GPU block ids and CPU slots; they never see requests' fence bookkeeping.
"""

from __future__ import annotations

import msgspec
from msgspec import field


class BlockCopy(msgspec.Struct, array_like=True):
    """The blocks one transfer job moves, as parallel lists (one entry per GPU block).

    ``sub_blocks[i]`` is the position of ``gpu_blocks[i]`` inside the chunk stored in
    ``cpu_slots[i]`` (0 .. blocks_per_chunk-1). A store copies GPU block -> slot position; a load
    copies slot position -> GPU block.
    """

    gpu_blocks: list[int]
    cpu_slots: list[int]
    sub_blocks: list[int]

    def __len__(self) -> int:
        return len(self.gpu_blocks)


class BlockContent(msgspec.Struct, array_like=True):
    """What a GPU block must hold: its KV group, the chained hash of the blocks before it, and
    its tokens. The synthetic model's KV is a function of exactly this (plus layer and rank)."""

    group: int
    parent_hash: int
    tokens: tuple[int, ...]


class TransferSpec(msgspec.Struct, array_like=True):
    """One job: one request's transfer in one direction for one step, on every rank."""

    job_id: int
    is_store: bool
    copy: BlockCopy
    # loads in verify mode: the expected content of each destination block (same order)
    expect: list[BlockContent] | None = None
    # verify mode: a store records each pool row's checksum once its copy has landed; a load
    # checks each source row's before copying it, and a mismatch fails the job as corrupt
    check_sums: bool = False
    # a load whose blocks the model reads in this very step: every rank finishes it before its
    # model step runs (otherwise the request runs only after every rank has acked the load)
    same_step: bool = False


class WriteSpan(msgspec.Struct, array_like=True):
    """KV the model writes this step for one request in one KV group: tokens at positions
    ``start .. start+len(tokens)-1`` go to ``blocks`` (one entry per block the span touches, in
    order) whose parent hashes are ``parent_hashes``."""

    group: int
    start: int
    tokens: list[int]
    blocks: list[int]
    parent_hashes: list[int]


class SamplingSpec(msgspec.Struct, frozen=True, array_like=True):
    """How a real model picks a request's tokens (the synthetic model ignores it): greedy at
    temperature 0; ``logprobs``: how many top log-probabilities to report besides the sampled
    token's (None: report none)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None


class TokenLogprobs(msgspec.Struct, array_like=True):
    """The sampled token's log-probability and the top ones (token id -> log-probability)."""

    logprob: float
    top: dict[int, float] = field(default_factory=dict)


class ModelOutput(msgspec.Struct, array_like=True):
    """What a rank's model answers for a step: per batch entry its part of the next token
    (0 for an entry that does not sample), and with a real model each sample's logprobs."""

    samples: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


class ModelEntry(msgspec.Struct, array_like=True):
    """One request in this step's model batch."""

    req_index: int  # the request's position in the batch reply
    writes: list[WriteSpan]
    # blocks whose KV the model reads to sample (all groups; null blocks excluded); empty when
    # the request does not sample this step (chunked prefill not yet at the end of its prompt)
    read_blocks: list[int]
    position: int  # position of the token being sampled (mixed into the sample)
    # every block of the request's table per KV group, up to this step's last position (null
    # entries where a window no longer reads): what a real model's attention gathers from
    block_tables: list[list[int]] = field(default_factory=list)
    sampling: SamplingSpec | None = None

    @property
    def start(self) -> int:
        """Position of the first token computed this step."""
        return self.writes[0].start

    @property
    def tokens(self) -> list[int]:
        """The tokens computed this step."""
        return self.writes[0].tokens


class TransferPlan(msgspec.Struct, array_like=True):
    """The transfer part of a step: jobs to finish now, jobs to report again, jobs to start
    (loads before the model step, stores after it)."""

    flush: list[int] = field(default_factory=list)
    # jobs unacked for too long: a rank that already reported one reports it again
    reack: list[int] = field(default_factory=list)
    loads: list[TransferSpec] = field(default_factory=list)
    stores: list[TransferSpec] = field(default_factory=list)


class StepPlan(msgspec.Struct, array_like=True):
    """The whole plan for one step, identical for every rank."""

    step: int
    transfers: TransferPlan = field(default_factory=TransferPlan)
    batch: list[ModelEntry] = field(default_factory=list)


class TransferStats(msgspec.Struct, array_like=True):
    """Per rank, per step: bytes and seconds spent copying, per direction."""

    store_jobs: int = 0
    store_blocks: int = 0
    store_bytes: int = 0
    store_seconds: float = 0.0
    load_jobs: int = 0
    load_blocks: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    flushes: int = 0
    flush_seconds: float = 0.0
    blocks_verified: int = 0
    mismatches: int = 0
    chunks_checked: int = 0  # CPU-pool rows whose checksum a load checked
    corrupt_detected: int = 0  # of those, rows whose bytes no longer matched

    def add(self, other: TransferStats) -> None:
        for name in self.__struct_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class TransferReport(msgspec.Struct, array_like=True):
    """The transfer part of a rank's reply: jobs that ended on it since its last report."""

    completed: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    stats: TransferStats = field(default_factory=TransferStats)
    corrupt: list[int] = field(default_factory=list)  # failed loads that read corrupt bytes


class StepReport(msgspec.Struct, array_like=True):
    """One rank's reply to one step."""

    rank: int
    step: int
    transfers: TransferReport = field(default_factory=TransferReport)
    samples: list[int] = field(default_factory=list)  # per sampling batch entry: this rank's part
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # a real model's, if asked
    busy_s: float = 0.0  # wall seconds the rank spent on the step: its copies and its model
