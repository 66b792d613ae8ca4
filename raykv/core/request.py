"""Request state shared by the engine and the connector."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from raykv.core.hashing import ROOT_HASH, check_cache_salt, extend_hashes, salted_root
from raykv.core.step import SamplingSpec, TokenLogprobs

# The status of a request the engine refused (bad token ids, too long, an id in use): it never
# became a ``Request``; reported beside the finished ones' ``RequestStatus`` values.
REJECTED = "rejected"


class RequestRefused(ValueError):
    """The engine refuses a request before it runs; ``field`` names the part of the request at
    fault (``prompt``, ``max_tokens`` or a sampling parameter), which a server reports as the
    error's parameter."""

    def __init__(self, message: str, field: str = "prompt") -> None:
        super().__init__(message)
        self.field = field


class RequestStatus(Enum):
    WAITING = "waiting"
    WAITING_FOR_LOAD = "waiting_for_load"  # blocks allocated, KV arriving from the CPU tier
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks taken back; will recompute (or reload) from scratch
    FINISHED_STOPPED = "finished_stopped"  # sampled EOS
    FINISHED_LENGTH = "finished_length"  # reached max_tokens
    FINISHED_ABORTED = "finished_aborted"
    # the engine could not compute the request's next token (its sampling raised on a rank):
    # the request ends, the engine and every other request go on
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    """One request: its tokens, how far its KV is computed, and its blocks per KV group.

    ``num_computed`` counts positions whose KV exists in the request's blocks, or is being
    computed by a step in flight (async scheduling counts a step's tokens when it plans it).
    ``tokens`` is the prompt followed by the generated tokens; the newest generated token has no
    KV until the next step computes it.
    """

    req_id: str
    index: int  # arrival order; also the request's position in reports and digests
    prompt: list[int]
    max_tokens: int
    eos_token: int | None = None
    tokens: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    max_computed: int = 0  # the highest num_computed ever reached (to count recomputation)
    block_tables: list[list[int]] = field(default_factory=list)  # per KV group
    num_cached_blocks: list[int] = field(default_factory=list)  # per group: published to GPU cache
    # the ranks' copy of the block tables (``ModelEntry.table_key``): its key (-1: the ranks
    # hold none) and how many entries per group it has
    table_key: int = -1
    tables_sent: int = 0
    hashes: list[int] = field(default_factory=list)  # chained hash of every full block of tokens
    num_preemptions: int = 0
    num_gpu_hit_tokens: int = 0  # first admission only
    num_cpu_hit_tokens: int = 0
    load_job: int | None = None
    load_tokens: int = 0  # tokens the load in flight brings after num_computed
    # tokens steps in flight are sampling for it, not yet in ``tokens`` (async scheduling plans
    # a step before the one before it has answered; 0 otherwise)
    num_pending: int = 0
    sampling: SamplingSpec | None = None  # a real model's sampling (None: greedy)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per generated token, if asked
    arrival_s: float | None = None  # wall clock when handed to the engine (``engine/latency``)
    queued_step: int = 0  # the engine step it joined the waiting queue in (admission order)
    last_token_s: float | None = None  # wall clock of its latest token
    admitted_s: float | None = None  # wall clock when it got its seat (first admission)
    loaded_s: float | None = None  # ... and when its load from a tier landed
    num_disk_hit_tokens: int = 0  # of its tier hit, tokens promoted from the disk tier
    num_shared_hit_tokens: int = 0  # ... and from the shared tier (Mooncake Store)
    # what the scheduler predicted when it decided on its tier hit: seconds to its prompt's
    # last token with the hit it took, and by recomputing (None: no tier hit was in reach)
    predicted_s: float | None = None
    predicted_recompute_s: float | None = None
    # its cache's tenant: requests with different salts never share a block (``core/hashing``)
    cache_salt: str | None = None
    root_hash: int = ROOT_HASH  # the parent of its first block (from the salt)

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.req_id}: empty prompt")
        if self.max_tokens <= 0:
            raise ValueError(f"request {self.req_id}: max_tokens must be positive")
        if not self.tokens:
            self.tokens = list(self.prompt)
        if self.cache_salt is not None:
            try:
                check_cache_salt(self.cache_salt)
            except ValueError as exc:
                raise RequestRefused(f"request {self.req_id}: {exc}", "cache_salt") from None
        self.root_hash = salted_root(self.cache_salt)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def finished(self) -> bool:
        return self.status.finished

    def update_hashes(self, block_size: int) -> list[int]:
        """Extend the chained hashes over any newly full blocks of ``tokens``."""
        return extend_hashes(self.hashes, self.tokens, block_size, self.root_hash)

    def reset_blocks(self, num_groups: int) -> None:
        self.block_tables = [[] for _ in range(num_groups)]
        self.num_cached_blocks = [0] * num_groups
        self.table_key = -1
        self.tables_sent = 0
