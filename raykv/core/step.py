"""The step message: what the scheduler sends to every rank each step, and what each rank sends
back. Each has a transfer part (the connector's: jobs to flush, load and store; their acks) and
a model part (the batch to compute; the sampled results).

Plain data: ints and lists in msgspec records (slotted like ``dataclass(slots=True)``), cheap to
build, to check in tests, and to encode for Ray as MessagePack arrays (``cluster/wire.py``).
Ranks see job ids, GPU block ids and CPU slots; they never see requests' fence bookkeeping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
from msgspec import field

from raykv.core.block_pool import NULL_BLOCK
from raykv.core.keys import key_group, key_hash, make_key


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


class ChunkKeys(msgspec.Struct, array_like=True):
    """Offload keys on the wire: a key is a 64-bit block hash and a KV-group index packed into
    one int of up to 72 bits (``core/keys.py``), more than MessagePack's ints carry, so keys
    travel as their two parts."""

    hashes: list[int] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, keys: Sequence[int]) -> ChunkKeys:
        return cls([key_hash(k) for k in keys], [key_group(k) for k in keys])

    def unpack(self) -> list[int]:
        return [make_key(h, g) for h, g in zip(self.hashes, self.groups, strict=True)]

    def __len__(self) -> int:
        return len(self.hashes)


TIER_DISK, TIER_SHARED = 0, 1  # the tiers below the CPU tier, as a move names them


class TierMove(msgspec.Struct, array_like=True):
    """One job between the CPU tier and a tier below it, on every rank: a demotion (disk) or a
    publish (shared) writes each chunk's CPU slot to the rank's file or store object of its
    key; a promotion reads each into its CPU slot. Ranks see keys and slots, never requests."""

    job_id: int
    promote: bool  # lower tier -> CPU slot (else CPU slot -> lower tier)
    chunks: ChunkKeys
    cpu_slots: list[int]  # one per key, same order
    # a demotion checks each page's bytes against the CPU pool's recorded checksum before
    # writing it (a corrupt chunk never reaches the disk); a promotion records the checksums it
    # verified for the CPU tier's loads (offload.verify)
    check_sums: bool = False
    tier: int = TIER_DISK  # which tier below the CPU tier: TIER_DISK or TIER_SHARED

    @classmethod
    def of(
        cls,
        job_id: int,
        promote: bool,
        keys: Sequence[int],
        slots: list[int],
        check: bool,
        tier: int = TIER_DISK,
    ) -> TierMove:
        return cls(job_id, promote, ChunkKeys.of(keys), slots, check, tier)


class WriteSpan(msgspec.Struct, array_like=True):
    """KV the model writes this step for one request in one KV group: tokens at positions
    ``start .. start+len(tokens)-1`` go to ``blocks`` (one entry per block the span touches, in
    order) whose parent hashes are ``parent_hashes``. A rank derives these from its entries
    (``ModelEntry.writes``); they do not travel."""

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

    def check(self) -> None:
        """``SamplingError`` naming the first field this engine cannot carry or compute; the
        one check every entry point (HTTP, the CLI, the Python API) reaches before a request
        is admitted, so no request can take a rank's step down."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError("temperature", self.temperature, "must be a finite number >= 0")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingError("top_p", self.top_p, "must be within (0, 1]")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise SamplingError(
                "top_k", self.top_k, f"must be within [0, {MAX_TOP_K}] (0: no limit)"
            )
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise SamplingError("seed", self.seed, f"must be within [{SEED_MIN}, {SEED_MAX}]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingError("logprobs", self.logprobs, f"must be within [0, {MAX_LOGPROBS}]")


# A seed travels in the step message, whose MessagePack ints are 64-bit: OpenAI's int64 range.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
# no vocabulary is larger, and the step message carries it as an int
MAX_TOP_K = 2**31 - 1
# top log-probabilities a token may report (each is a pair in every rank's reply, every step)
MAX_LOGPROBS = 20


class SamplingError(ValueError):
    """A sampling parameter out of what the engine computes; ``field`` names it."""

    def __init__(self, name: str, value: object, problem: str) -> None:
        super().__init__(f"{name} {value!r}: {problem}")
        self.field = name
        self.value = value
        self.problem = problem


class TokenLogprobs(msgspec.Struct, array_like=True):
    """The sampled token's log-probability and the top ones (token id -> log-probability)."""

    logprob: float
    top: dict[int, float] = field(default_factory=dict)


# A sample a rank could not draw (its request's sampling raised there): that request fails
# alone, the step and every other request go on.
SAMPLE_FAILED = -1


class ModelOutput(msgspec.Struct, array_like=True):
    """What a rank's model answers for a step: per batch entry its part of the next token
    (0 for an entry that does not sample, ``SAMPLE_FAILED`` where drawing it raised), and with
    a real model each sample's logprobs."""

    samples: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


class ModelEntry(msgspec.Struct, array_like=True):
    """One request in this step's model batch: the tokens it computes (positions ``start ..
    end - 1``), into the blocks its tables hold for those positions in every KV group.

    Its block tables travel as changes: the ranks keep every running request's tables between
    steps (``engine/rank_tables.py``), so a step sends only the entries from ``table_from`` on
    (on a decode step, none or one per group), never a long request's whole table again.
    """

    req_index: int  # the request's position in the batch reply
    # which of the ranks' kept tables this is: fresh for every table sent whole (a request
    # preempted and admitted again gets a new key), dropped by the ranks on ``StepPlan.forget``
    table_key: int
    start: int  # position of the first token computed this step
    tokens: list[int]
    # per KV group, the request's table entries from index ``table_from`` up to this step's
    # last position. The ranks replace their kept entries from ``table_from`` on with these
    # (0: the whole table, a new key) and hand the model the whole table: what a real model's
    # attention gathers from. Entries before a sliding window's reach may be stale there (the
    # scheduler nulls blocks that leave the window without telling the ranks); nothing reads them
    block_tables: list[list[int]]
    table_from: int = 0
    # per KV group, the first table index the sampled token still attends to; empty when the
    # request does not sample this step (chunked prefill not yet at the end of its prompt).
    # One int per group instead of the blocks themselves: the tables already carry them
    read_from: list[int] = field(default_factory=list)
    # the synthetic model's KV is a function of each written block's parent hash (one per block
    # the tokens touch, the same in every group); a real model's plans leave them out
    parent_hashes: list[int] = field(default_factory=list)
    sampling: SamplingSpec | None = None

    @property
    def end(self) -> int:
        """Position of the token this step samples (one past the last computed)."""
        return self.start + len(self.tokens)

    @property
    def samples(self) -> bool:
        """Whether this step samples the request's next token."""
        return bool(self.read_from)

    def _written(self, block_size: int) -> slice:
        """The table entries the tokens are written into."""
        return slice(self.start // block_size, (self.end - 1) // block_size + 1)

    def written_blocks(self, block_size: int) -> list[int]:
        """The blocks the tokens are written into, every group (whole tables: on a rank)."""
        written = self._written(block_size)
        return [block for table in self.block_tables for block in table[written]]

    def writes(self, block_size: int) -> list[WriteSpan]:
        """What the tokens write, per group (whole tables: on a rank)."""
        written = self._written(block_size)
        return [
            WriteSpan(group, self.start, self.tokens, table[written], self.parent_hashes)
            for group, table in enumerate(self.block_tables)
        ]

    def read_blocks(self) -> list[int]:
        """The blocks whose KV the model reads to sample (every group, null blocks left out;
        empty when the request does not sample; whole tables: on a rank)."""
        return [
            block
            for table, first in zip(self.block_tables, self.read_from, strict=True)
            for block in table[first:]
            if block != NULL_BLOCK
        ]


class TransferPlan(msgspec.Struct, array_like=True):
    """The transfer part of a step: jobs to finish now, jobs to report again, jobs to start
    (loads before the model step, stores after it)."""

    flush: list[int] = field(default_factory=list)
    # jobs unacked for too long: a rank that already reported one reports it again
    reack: list[int] = field(default_factory=list)
    loads: list[TransferSpec] = field(default_factory=list)
    stores: list[TransferSpec] = field(default_factory=list)
    # the tiers below the CPU tier: their moves (queued before the model), the keys whose disk
    # files go (evicted or found corrupt) and whose parts leave the shared store (found
    # corrupt), removed before anything of this plan is queued
    tier_moves: list[TierMove] = field(default_factory=list)
    disk_drops: ChunkKeys = field(default_factory=ChunkKeys)
    shared_drops: ChunkKeys = field(default_factory=ChunkKeys)


class StepPlan(msgspec.Struct, array_like=True):
    """The whole plan for one step, identical for every rank."""

    step: int
    transfers: TransferPlan = field(default_factory=TransferPlan)
    batch: list[ModelEntry] = field(default_factory=list)
    # the ranks' kept block tables: keys of tables to drop (their requests freed their blocks),
    # dropped before the batch's entries are applied; and the tables' epoch: a recovery starts a
    # new one, and a rank that sees a new epoch drops every table it keeps (a new rank has none)
    forget: list[int] = field(default_factory=list)
    tables_epoch: int = 0


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
    # the disk tier, per direction: chunks, bytes and seconds of the I/O threads' work
    disk_write_chunks: int = 0
    disk_write_bytes: int = 0
    disk_write_seconds: float = 0.0
    disk_read_chunks: int = 0
    disk_read_bytes: int = 0
    disk_read_seconds: float = 0.0
    disk_corrupt: int = 0  # chunk files that failed their checks (torn, changed, missing)
    # names of chunks that were no regular file (a FIFO, a link, a directory): taken away
    disk_special: int = 0
    # the shared tier (Mooncake Store), per direction: publishes out, promotions in
    shared_write_chunks: int = 0
    shared_write_bytes: int = 0
    shared_write_seconds: float = 0.0
    shared_read_chunks: int = 0
    shared_read_bytes: int = 0
    shared_read_seconds: float = 0.0
    shared_corrupt: int = 0  # parts that failed their checks (removed from the store)

    def add(self, other: TransferStats) -> None:
        for name in self.__struct_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class TransferReport(msgspec.Struct, array_like=True):
    """The transfer part of a rank's reply: jobs that ended on it since its last report."""

    completed: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    stats: TransferStats = field(default_factory=TransferStats)
    corrupt: list[int] = field(default_factory=list)  # failed loads that read corrupt bytes
    # failed demotions that found the disk full (ENOSPC): the tier stops admitting for a while
    full: list[int] = field(default_factory=list)
    # failed promotions whose reads may still land in their CPU slots (not reused for a while)
    unsettled: list[int] = field(default_factory=list)
    # per failed move, the keys whose source this rank found bad (a file that failed its
    # checks, a part missing or spoiled): those leave their tier, the job's others stay
    bad_keys: dict[int, ChunkKeys] = field(default_factory=dict)


class StepReport(msgspec.Struct, array_like=True):
    """One rank's reply to one step."""

    rank: int
    step: int
    transfers: TransferReport = field(default_factory=TransferReport)
    samples: list[int] = field(default_factory=list)  # per sampling batch entry: this rank's part
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # a real model's, if asked
    busy_s: float = 0.0  # wall seconds the rank spent on the step: its copies and its model
    model_s: float = 0.0  # of those, the model's own (what a prefill costs, for the tiers)
