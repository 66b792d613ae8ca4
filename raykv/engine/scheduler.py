"""Request scheduling over the paged GPU KV cache.

Waiting and running queues, a per-step token budget with chunked prefill, GPU prefix caching,
admission through the connector (a request whose prefix the CPU tier holds waits for its load),
and preemption by recompute when blocks run out. Every block allocation, from every path, is
reported to the connector, which fences blocks that unfinished stores still read.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from raykv.connector.scheduler import ConnectorScheduler, ScheduledRequest
from raykv.core.block_pool import NULL_BLOCK, BlockPool
from raykv.core.keys import make_key
from raykv.core.kv_groups import KVGroup
from raykv.core.request import Request, RequestStatus


class RequestTooLarge(ValueError):
    """A request needs more GPU blocks than the whole pool holds."""


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    started_loads: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass(slots=True)
class SchedulerStats:
    preemptions: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    recomputed_tokens: int = 0  # prompt tokens computed again after a preemption or failed load
    # tokens each admission had to provide, from a cache or by computing them (re-admissions after
    # a preemption, a failed load or a rank restart count again): what hits are a share of
    admitted_tokens: int = 0
    deferred: int = 0


class Scheduler:
    """Decides, each step, which requests compute how many tokens."""

    def __init__(
        self,
        pool: BlockPool,
        groups: list[KVGroup],
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        connector: ConnectorScheduler | None = None,
    ) -> None:
        self.pool = pool
        self.groups = groups
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # requests whose KV is arriving from the CPU tier (by object: an aborted one keeps its
        # blocks until its load lands, while a new request may already reuse its id)
        self.loading: list[Request] = []
        self.stats = SchedulerStats()

    # ---- queue management ---------------------------------------------------------------------

    def add(self, req: Request) -> None:
        # the last sampled token never gets KV: positions with KV top out one short
        need = self.max_blocks_needed(req.num_prompt + req.max_tokens - 1)
        if need > self.pool.num_usable:
            raise RequestTooLarge(
                f"request {req.req_id}: {req.num_prompt} prompt + {req.max_tokens} output tokens "
                f"need {need} GPU blocks; the pool has {self.pool.num_usable}"
            )
        req.reset_blocks(len(self.groups))
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # ---- block accounting -----------------------------------------------------------------------

    def max_blocks_needed(self, tokens: int) -> int:
        """The most blocks a request of ``tokens`` positions ever holds at once when it runs
        alone: every block for a full-attention group; for a sliding-window group its window
        plus one step's worth of new tokens (earlier blocks are freed as it goes)."""
        bs, budget = self.block_size, self.max_num_batched_tokens
        total = 0
        for group in self.groups:
            blocks = -(-tokens // bs)
            if group.is_sliding:
                assert group.window_tokens is not None
                # a step reads W - 1 earlier positions and writes up to a budget's worth
                span = group.window_tokens - 1 + budget
                blocks = min(blocks, -(-span // bs) + 1)
            total += blocks
        return total

    def _local_hit(self, req: Request) -> tuple[int, list[list[int]]]:
        """The GPU prefix-cache hit: tokens, and per group the table entries covering them."""
        bs, pool = self.block_size, self.pool
        hashes = req.update_hashes(bs)
        limit = min(len(hashes), (req.num_tokens - 1) // bs)
        n = limit
        for g, group in enumerate(self.groups):
            if group.is_sliding:
                continue
            k = 0
            while k < n and pool.lookup(make_key(hashes[k], g)) is not None:
                k += 1
            n = k
        while n > 0 and not all(
            pool.lookup(make_key(hashes[b], g)) is not None
            for g, group in enumerate(self.groups)
            if group.is_sliding
            for b in range(group.first_needed_block(n * bs, bs), n)
        ):
            n -= 1
        tables = []
        for g, group in enumerate(self.groups):
            first = group.first_needed_block(n * bs, bs)
            tables.append(
                [
                    NULL_BLOCK if b < first else pool.lookup(make_key(hashes[b], g)) or NULL_BLOCK
                    for b in range(n)
                ]
            )
        return n * bs, tables

    def _admit(self, req: Request, local: list[list[int]], start: int, end: int) -> bool:
        """Give a waiting request its cached blocks plus fresh ones for positions up to ``end``
        (computing or loading resumes at ``start``). All or nothing."""
        bs, pool = self.block_size, self.pool
        revive = sum(1 for t in local for b in t if b != NULL_BLOCK and pool.ref_count(b) == 0)
        fresh_needed = 0
        plans = []
        for group, table in zip(self.groups, local, strict=True):
            first = group.first_needed_block(start, bs)
            have = len(table)
            need = -(-end // bs)
            positions = range(have, need)
            n_new = sum(1 for b in positions if b >= first)
            fresh_needed += n_new
            plans.append((first, positions))
        if fresh_needed + revive > pool.num_free:
            return False
        new_entries: list[list[int]] = []
        fresh_all: list[int] = []
        # cached blocks before the window are not needed: keep only what is read. Revive every
        # group's cached blocks before allocating any fresh one, or an allocation could hand out
        # (and drop from the cache) a free block another group is about to revive.
        kept = [
            [b if i >= first else NULL_BLOCK for i, b in enumerate(table)]
            for (first, _), table in zip(plans, local, strict=True)
        ]
        for entries in kept:
            for b in entries:
                if b != NULL_BLOCK:
                    pool.acquire(b)
        for (first, positions), entries in zip(plans, kept, strict=True):
            n_new = sum(1 for b in positions if b >= first)
            fresh = pool.allocate(n_new)
            fresh_all += fresh
            it = iter(fresh)
            entries += [next(it) if b >= first else NULL_BLOCK for b in positions]
            new_entries.append(entries)
        for table, entries in zip(req.block_tables, new_entries, strict=True):
            table.extend(entries)
        req.num_cached_blocks = [len(t) for t in local]
        if self.connector is not None:
            self.connector.on_allocated(req, new_entries, fresh_all)
        return True

    def _grow(self, req: Request, end: int) -> bool:
        """Extend a running request's tables to hold positions up to ``end``, first freeing the
        sliding-window blocks that the tokens computed from now on no longer read."""
        bs, pool = self.block_size, self.pool
        self._drop_out_of_window(req, req.num_computed)
        need = 0
        for table in req.block_tables:
            need += max(0, -(-end // bs) - len(table))
        if need > pool.num_free:
            return False
        new_entries: list[list[int]] = []
        fresh_all: list[int] = []
        for table in req.block_tables:
            n_new = max(0, -(-end // bs) - len(table))
            fresh = pool.allocate(n_new)
            table.extend(fresh)
            fresh_all += fresh
            new_entries.append(fresh)
        if self.connector is not None and fresh_all:
            self.connector.on_allocated(req, new_entries, fresh_all)
        return True

    def _drop_out_of_window(self, req: Request, next_position: int) -> None:
        bs = self.block_size
        for g, (group, table) in enumerate(zip(self.groups, req.block_tables, strict=True)):
            if not group.is_sliding:
                continue
            first = min(group.first_needed_block(next_position, bs), len(table))
            positions = [i for i in range(first) if table[i] != NULL_BLOCK]
            if positions:
                if self.connector is not None:
                    self.connector.on_released(req, g, positions)
                self.pool.free(reversed([table[i] for i in positions]))
                for i in positions:
                    table[i] = NULL_BLOCK

    def _free_all(self, req: Request) -> None:
        """Release every block (tails first, so they are reused first)."""
        blocks = [b for table in req.block_tables for b in reversed(table) if b != NULL_BLOCK]
        self.pool.free(blocks)
        req.reset_blocks(len(self.groups))

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            while not self._grow(req, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted itself; the list shrank, i points at the next one
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            i += 1
        if out.preempted:
            return out  # no admissions in a step that had to take blocks back
        self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0:
            if len(self.running) + len(self.loading) >= self.max_num_seqs:
                break
            req = self.waiting.popleft()
            num_local, local = self._local_hit(req)
            ext = 0
            if self.connector is not None:
                ext = self.connector.lookup(req, num_local)
                if ext is None:
                    self.stats.deferred += 1
                    skipped.append(req)
                    continue
            if ext > 0:
                end = num_local + ext
                if not self._admit(req, local, end, end):
                    self.waiting.appendleft(req)
                    break
                self._count_hits(req, num_local, ext)
                req.num_computed = num_local
                req.load_tokens = ext
                req.status = RequestStatus.WAITING_FOR_LOAD
                self.loading.append(req)
                self.connector.start_load(req, num_local, ext)  # type: ignore[union-attr]
                out.started_loads += 1
                continue
            n = min(req.num_tokens - num_local, budget)
            if not self._admit(req, local, num_local, num_local + n):
                self.waiting.appendleft(req)
                break
            self._count_hits(req, num_local, 0)
            req.num_computed = num_local
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _count_hits(self, req: Request, local: int, ext: int) -> None:
        if req.num_preemptions == 0 and req.num_gpu_hit_tokens + req.num_cpu_hit_tokens == 0:
            req.num_gpu_hit_tokens, req.num_cpu_hit_tokens = local, ext
        self.stats.gpu_hit_tokens += local
        self.stats.cpu_hit_tokens += ext
        self.stats.admitted_tokens += req.num_tokens

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._free_all(req)
        req.num_computed = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        out.scheduled = [s for s in out.scheduled if s.req is not req]

    # ---- after the step -------------------------------------------------------------------------

    def finish_load(self, req: Request, ok: bool) -> Request | None:
        """A load ended. On success the request runs on from after the loaded tokens. On failure
        it gives its blocks back and waits to be admitted again (its blocks were laid out for
        resuming after the load: a sliding-window group holds none before that window), so it
        recomputes from whatever the GPU prefix cache then still holds."""
        if req not in self.loading:
            return None
        self.loading.remove(req)
        if req.status is RequestStatus.FINISHED_ABORTED:
            self._free_all(req)  # its blocks were kept until the load stopped writing them
            return req
        req.load_job = None
        if ok:
            req.num_computed += req.load_tokens
            req.load_tokens = 0
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            return req
        req.load_tokens = 0
        self._free_all(req)
        req.num_computed = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        return req

    def restart_all(self) -> list[Request]:
        """Every request with KV on the GPU gives its blocks back and waits to recompute from
        scratch (a rank's KV is gone). Returns the requests that held blocks."""
        moved: list[Request] = []
        for req in [*self.running, *self.loading]:
            if req.status is RequestStatus.FINISHED_ABORTED:
                self._free_all(req)  # its load was what kept it
                continue
            self._free_all(req)
            req.num_computed = 0
            req.load_tokens = 0
            req.load_job = None
            req.status = RequestStatus.PREEMPTED
            req.num_preemptions += 1
            moved.append(req)
        self.running.clear()
        self.loading.clear()
        for req in sorted(moved, key=lambda r: r.index, reverse=True):
            self.waiting.appendleft(req)
        return moved

    def publish(self, req: Request) -> None:
        """Publish the request's newly full, computed blocks to the GPU prefix cache."""
        bs, pool = self.block_size, self.pool
        hashes = req.update_hashes(bs)
        full = min(req.num_computed // bs, len(hashes))
        for g, table in enumerate(req.block_tables):
            for b in range(req.num_cached_blocks[g], min(full, len(table))):
                if table[b] != NULL_BLOCK:
                    pool.cache(table[b], make_key(hashes[b], g))
            req.num_cached_blocks[g] = max(req.num_cached_blocks[g], min(full, len(table)))

    def note_computed(self, req: Request, start: int, end: int) -> None:
        """Count tokens computed a second time (after a preemption or a failed load)."""
        prev = req.max_computed
        self.stats.recomputed_tokens += max(0, min(end, prev) - start)
        req.max_computed = max(prev, end)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request and free its blocks (an in-flight load keeps them until it lands)."""
        req.status = status
        if req in self.loading:
            return  # freed when the load finishes
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free_all(req)
