"""What the connector remembers about each request, and the changes that state goes through.

A state belongs to one admission of a request (one ``Request`` object), from its first lookup
until it has finished and its last job is final: never to a request id, which a later request
may reuse once this one is forgotten.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from raykv.core.block_pool import NULL_BLOCK
from raykv.core.hashing import parent_hash
from raykv.core.keys import make_key
from raykv.core.request import Request
from raykv.core.step import BlockContent


@dataclass(slots=True)
class GroupState:
    """One KV group of one tracked request."""

    keys: list[int] = field(default_factory=list)  # offload key of each full chunk
    block_ids: list[int] = field(default_factory=list)  # GPU block per block index (0 = none)
    next_stored_chunk: int = 0  # the store cursor


@dataclass(slots=True)
class RequestOffloadState:
    """One request's offload keys, GPU blocks and store cursor per group, and its jobs: one
    load, or any number of stores (DESIGN invariant 3)."""

    req: Request
    groups: list[GroupState]
    jobs: set[int] = field(default_factory=set)
    has_load: bool = False
    finished: bool = False
    finished_signaled: bool = False  # its last store was planned: no more jobs after that
    deferred_since: float | None = None  # when its lookups started being deferred
    # seconds it waited for the tiers (chunks being written, promotions, room) in the spells
    # before this one, and when this one began (the wait is bounded by time, per request, in
    # all; ``PrefixLookup``'s clock)
    waited_s: float = 0.0
    wait_since: float | None = None
    # the longest its wait for the chosen hit is worth (``Decision.wait_s``; None: only
    # ``engine.max_wait_s`` bounds it), decided with ``choice``
    wait_limit_s: float | None = None
    wait_over: bool = False  # it waited its share: it takes what is readable now, or recomputes
    # a load of this request failed on some rank: it recomputes from then on, or a copy path
    # that fails every time would have it load, fail and load again for ever
    load_failed: bool = False
    # the same for the disk tier: a promotion it waited for failed, so it looks past the CPU
    # tier no more
    disk_failed: bool = False
    promoted: set[int] = field(default_factory=set)  # keys promoted from disk for it
    fetched: set[int] = field(default_factory=set)  # keys promoted from the shared store for it
    store_asked: bool = False  # the shared store was asked what it holds for this admission
    # the tier hit it chose to load (to this token; its start: recompute), kept while it waits
    # for what it chose (a decision and its probe count once per admission)
    choice: int | None = None

    @classmethod
    def new(cls, req: Request, num_groups: int) -> RequestOffloadState:
        return cls(req, [GroupState() for _ in range(num_groups)])

    def update_keys(self, block_size: int, blocks_per_chunk: int) -> None:
        """Extend each group's keys over the request's newly full chunks."""
        hashes, bpc = self.req.update_hashes(block_size), blocks_per_chunk
        n_chunks = len(hashes) // bpc
        for g, gs in enumerate(self.groups):
            for c in range(len(gs.keys), n_chunks):
                gs.keys.append(make_key(hashes[(c + 1) * bpc - 1], g))

    def holds_blocks(self) -> bool:
        return any(gs.block_ids for gs in self.groups)

    def clear_blocks(self) -> None:
        """The request lost its GPU blocks (preempted, failed load, restart)."""
        for gs in self.groups:
            gs.block_ids.clear()

    def advance(self, storable_chunks: int, blocks_per_chunk: int) -> None:
        """Move each group's store cursor up to ``storable_chunks`` (as far as it has blocks)."""
        for gs in self.groups:
            stop = min(storable_chunks, len(gs.block_ids) // blocks_per_chunk)
            gs.next_stored_chunk = max(gs.next_stored_chunk, stop)

    def chunk_blocks(self, group: int, chunk: int, bpc: int) -> list[int]:
        return self.groups[group].block_ids[chunk * bpc : (chunk + 1) * bpc]

    def unstored_chunks(self, storable_chunks: int, bpc: int) -> list[tuple[int, int, int]]:
        """(group, chunk, key) of every chunk from the store cursor up to ``storable_chunks``
        whose blocks are all still on the GPU (a sliding-window block may be gone already)."""
        wanted: list[tuple[int, int, int]] = []
        for g, gs in enumerate(self.groups):
            stop = min(storable_chunks, len(gs.block_ids) // bpc)
            for c in range(gs.next_stored_chunk, stop):
                if NULL_BLOCK not in gs.block_ids[c * bpc : (c + 1) * bpc]:
                    wanted.append((g, c, gs.keys[c]))
        return wanted

    def store_targets(
        self,
        wanted: list[tuple[int, int, int]],
        slot_of: dict[int, int],
        bpc: int,
        sliding: list[bool],
    ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """What a store of the ``wanted`` chunks (``unstored_chunks``) that got a CPU slot in
        ``slot_of`` copies: GPU blocks, the slot and the position in it of each, and the blocks
        fenced now (sliding-window groups', which the request may free while it runs, or all
        of a finished request's) and those fenced when the request ends."""
        blocks: list[int] = []
        slots: list[int] = []
        subs: list[int] = []
        fenced: list[int] = []
        deferred: list[int] = []
        for g, c, key in wanted:
            slot = slot_of.get(key)
            if slot is None:
                continue  # already stored (or filtered): nothing to copy
            chunk_blocks = self.chunk_blocks(g, c, bpc)
            blocks.extend(chunk_blocks)
            slots.extend([slot] * bpc)
            subs.extend(range(bpc))
            (fenced if sliding[g] or self.finished else deferred).extend(chunk_blocks)
        return blocks, slots, subs, fenced, deferred

    def promoted_tokens(
        self, start: int, end: int, tokens_per_chunk: int, shared: bool = False
    ) -> int:
        """Of token positions ``start .. end - 1``, how many lie in chunks that (in some group)
        were promoted from the disk tier (``shared``: from the shared store) for this request
        (a chunk the range cuts counts only its part in the range)."""
        promoted, tpc = (self.fetched if shared else self.promoted), tokens_per_chunk
        if not promoted or end <= start:
            return 0
        return sum(
            min(end, (c + 1) * tpc) - max(start, c * tpc)
            for c in range(start // tpc, -(-end // tpc))
            if any(c < len(gs.keys) and gs.keys[c] in promoted for gs in self.groups)
        )

    def load_targets(
        self, first: int, last: int, block_size: int, bpc: int, verify: bool
    ) -> tuple[list[int], list[int], list[int], list[BlockContent] | None]:
        """The blocks a load of block positions ``first .. last-1`` writes (every group; null
        entries, outside a window, skipped): GPU blocks, the chunk key each comes from, its
        position in that chunk, and with ``verify`` what each must hold afterwards."""
        req, bs = self.req, block_size
        blocks: list[int] = []
        chunk_keys: list[int] = []
        subs: list[int] = []
        expect: list[BlockContent] | None = [] if verify else None
        for g, gs in enumerate(self.groups):
            for i in range(first, last):
                block = gs.block_ids[i]
                if block == NULL_BLOCK:
                    continue
                blocks.append(block)
                chunk_keys.append(gs.keys[i // bpc])
                subs.append(i % bpc)
                if expect is not None:
                    tokens = tuple(req.tokens[i * bs : (i + 1) * bs])
                    expect.append(
                        BlockContent(g, parent_hash(req.hashes, i, req.root_hash), tokens)
                    )
        return blocks, chunk_keys, subs, expect

    def add_job(self, job_id: int, is_store: bool) -> None:
        assert not (self.has_load or (not is_store and self.jobs)), (
            f"request {self.req.req_id}: one load xor many stores"
        )
        self.jobs.add(job_id)
        if not is_store:
            self.has_load = True
            self.req.load_job = job_id

    def end_job(self, job_id: int, is_store: bool) -> None:
        """A job of this request is final. A failed load is recomputed; its chunks are still in
        the CPU tier, so the store cursor stays past them."""
        self.jobs.discard(job_id)
        if not is_store:
            self.has_load = False
            self.req.load_job = None

    def rewind(self) -> None:
        """Every job was abandoned and the tier may be empty: store everything again."""
        self.jobs.clear()
        self.has_load = False
        self.req.load_job = None
        for gs in self.groups:
            gs.next_stored_chunk = 0

    @property
    def forgettable(self) -> bool:
        return self.finished_signaled and not self.jobs


class ReleasedBlocks:
    """Sliding-window blocks that running requests gave back (they left the window) before
    storing them. Such a block keeps its KV, and stays storable, until the pool hands it out
    again; from then on the old position must never be stored (it would store the new owner's
    KV under the old key, vLLM #42959), so its entry is cleared. A released position already
    behind the store cursor is cleared at once: nothing reads it again (a reset that rewinds the
    cursor must not find another owner's block there)."""

    def __init__(self) -> None:
        self._by_block: dict[int, list[tuple[RequestOffloadState, int, int]]] = {}

    def release(
        self, state: RequestOffloadState, group: int, positions: Sequence[int], bpc: int
    ) -> None:
        gs = state.groups[group]
        stored_below = gs.next_stored_chunk * bpc
        for i in positions:
            block = gs.block_ids[i]
            if block == NULL_BLOCK:
                continue
            if i < stored_below:
                gs.block_ids[i] = NULL_BLOCK
            else:
                self._by_block.setdefault(block, []).append((state, group, i))

    def reallocated(self, fresh: Iterable[int]) -> None:
        """These blocks were handed out again: clear the positions that released them."""
        by_block = self._by_block
        if not by_block:
            return
        for block in fresh:
            for state, group, i in by_block.pop(block, ()):
                ids = state.groups[group].block_ids
                if i < len(ids) and ids[i] == block:
                    ids[i] = NULL_BLOCK
