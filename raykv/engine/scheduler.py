"""Request scheduling over the paged GPU KV cache, and the connector's only caller.

Waiting and running queues, a per-step token budget with chunked prefill, admission through the
connector (a request whose prefix the CPU tier holds waits for its load), load waits, and
preemption by recompute when blocks run out. Block-table arithmetic is the KV-cache manager's
(``core/kv_cache.py``); it reports every allocation and release here, and this scheduler passes
them on to the connector. The connector is called in the protocol's order: lookup, allocations
(with the load of an admitted hit), the step's plan, the ranks' reports, finished requests (and
resets).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from raykv.connector.scheduled import ScheduledRequest
from raykv.connector.scheduler import ConnectorScheduler
from raykv.core.block_pool import BlockPool
from raykv.core.kv_cache import KVCacheManager
from raykv.core.kv_groups import KVGroup
from raykv.core.request import Request, RequestRefused, RequestStatus
from raykv.core.step import StepReport
from raykv.engine.admission import AdmissionOrder
from raykv.engine.step_output import SchedulerOutput, SchedulerStats


class RequestTooLarge(RequestRefused):
    """A request needs more GPU blocks than the whole pool holds."""


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
        *,
        policy: str = "fcfs",
        max_bypass_steps: int = 16,
        short_prefill_alone: int = 0,
    ) -> None:
        """With a connector whose ``load_in_step`` is set, a request admitted with a CPU-tier hit
        also computes the rest of its prompt (as far as the step's budget goes) in the step that
        loads it. ``policy``, ``max_bypass_steps`` and ``short_prefill_alone``: the admission
        order and the decode hold-back (``engine/admission.py``)."""
        self.admission = AdmissionOrder(
            policy, max_bypass_steps, short_prefill_alone, self._prefill_left
        )
        self._step = 0
        self.pool = pool
        self.groups = groups
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.connector = connector
        self.kv = KVCacheManager(pool, groups, block_size, max_num_batched_tokens, self)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # requests whose KV is arriving from the CPU tier (by object: an aborted one keeps its
        # blocks until its load lands, while a new request may already reuse its id)
        self.loading: list[Request] = []
        self.stats = SchedulerStats()

    # ---- queue management ---------------------------------------------------------------------

    def check_fits(self, req: Request) -> None:
        """RequestTooLarge if ``req`` could never fit the GPU pool, even alone."""
        # the last sampled token never gets KV: positions with KV top out one short
        need = self.kv.max_blocks_needed(req.num_prompt + req.max_tokens - 1)
        if need > self.pool.num_usable:
            # the output is at fault where the prompt with one token would fit
            alone = self.kv.max_blocks_needed(req.num_prompt) <= self.pool.num_usable
            raise RequestTooLarge(
                f"request {req.req_id}: {req.num_prompt} prompt + {req.max_tokens} output tokens "
                f"need {need} GPU blocks; the pool has {self.pool.num_usable}",
                "max_tokens" if alone else "prompt",
            )

    def add(self, req: Request) -> None:
        self.check_fits(req)
        req.reset_blocks(len(self.groups))
        req.status = RequestStatus.WAITING
        req.queued_step = self._step
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def has_pending_transfers(self) -> bool:
        """Jobs in flight or finished requests still to close: keep stepping."""
        return self.connector is not None and self.connector.has_pending_work()

    # ---- the KV-cache manager's feed, passed on to the connector -------------------------------

    def on_allocated(
        self, req: Request, new_entries: Sequence[Sequence[int]], fresh: Sequence[int]
    ) -> None:
        if self.connector is not None:
            # an admission with a CPU hit brings its load: the tokens after num_computed
            load = req.load_tokens if req.status is RequestStatus.WAITING_FOR_LOAD else 0
            self.connector.on_allocated(req, new_entries, fresh, load)

    def on_released(self, req: Request, group: int, positions: Sequence[int]) -> None:
        if self.connector is not None:
            self.connector.on_released(req, group, positions)

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self, step: int) -> SchedulerOutput:
        self._step = step
        out = SchedulerOutput(step)
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and len(req.output) + req.num_pending >= req.max_tokens:
                i += 1  # the step in flight samples its last token: it ends when that answers
                continue
            n = min(req.num_tokens + req.num_pending - req.num_computed, budget)
            while not self.kv.grow(req, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted itself; the list shrank, i points at the next one
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            i += 1
        if not out.preempted:  # no admissions in a step that had to take blocks back
            self._admit_waiting(out, budget)
        held = self.admission.hold_decodes(out.scheduled, bool(self.waiting))
        if held is not None:
            out.scheduled = held
        if self.connector is not None:
            out.transfers = self.connector.plan(step, out.scheduled, out.preempted)
        out.attention = out.attention_work()
        return out

    def _prefill_left(self, req: Request) -> int:
        """About how many prompt tokens ``req`` computes once the GPU prefix cache and the
        tiers have supplied theirs (a peek: nothing changes)."""
        num_local = self.kv.local_hit(req)[0]
        cached = num_local
        if self.connector is not None:
            cached += self.connector.peek(req, num_local)
        return req.num_tokens - max(req.num_computed, cached)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        self.admission.reorder(self.waiting, self._step)
        skipped: list[Request] = []
        while self.waiting and budget > 0:
            if len(self.running) + len(self.loading) >= self.max_num_seqs:
                break
            req = self.waiting.popleft()
            if req.num_pending:
                # preempted while a step in flight samples for it: it waits for that token
                skipped.append(req)
                continue
            num_local, local = self.kv.local_hit(req)
            ext = 0
            if self.connector is not None:
                ext = self.connector.lookup(req, num_local)
                if ext is None:
                    self.stats.deferred += 1
                    skipped.append(req)
                    continue
            if ext > 0:
                n = 0  # tokens it computes beside its load, in the same step
                if self.connector is not None and self.connector.load_in_step:
                    n = min(req.num_tokens - num_local - ext, budget)
                if not self._admit_loading(req, local, num_local, ext, n):
                    self.waiting.appendleft(req)
                    break
                out.started_loads += 1
                if n:
                    out.scheduled.append(ScheduledRequest(req, n, loading=True))
                    budget -= n
                continue
            n = min(req.num_tokens - num_local, budget)
            if not self.kv.admit(req, local, num_local, num_local + n):
                self.waiting.appendleft(req)
                break
            self._count_hits(req, num_local, 0)
            req.num_computed = num_local
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _admit_loading(
        self, req: Request, local: list[list[int]], num_local: int, ext: int, compute: int = 0
    ) -> bool:
        """Admit a request whose next ``ext`` tokens come from the CPU tier: its blocks are
        allocated now (the connector plans the load with them, and ``compute`` tokens after it
        get theirs too when the request computes in the load's step) and it waits for the
        load."""
        status, computed = req.status, req.num_computed
        req.num_computed, req.load_tokens = num_local, ext
        req.status = RequestStatus.WAITING_FOR_LOAD
        end = num_local + ext
        if not self.kv.admit(req, local, end, end + compute):
            req.status, req.num_computed, req.load_tokens = status, computed, 0
            return False
        self._count_hits(req, num_local, ext)
        self.loading.append(req)
        return True

    def _count_hits(self, req: Request, local: int, ext: int) -> None:
        c = self.connector if ext else None
        disk = c.disk_tokens(req, local, ext) if c else 0
        shared = c.disk_tokens(req, local, ext, shared=True) if c else 0
        hits = req.num_gpu_hit_tokens + req.num_cpu_hit_tokens + req.num_disk_hit_tokens
        if req.num_preemptions == 0 and hits + req.num_shared_hit_tokens == 0:
            req.num_gpu_hit_tokens, req.num_cpu_hit_tokens = local, ext - disk - shared
            req.num_disk_hit_tokens, req.num_shared_hit_tokens = disk, shared
        if req.admitted_s is None:
            req.admitted_s = time.perf_counter()
        self.stats.gpu_hit_tokens += local
        self.stats.cpu_hit_tokens += ext - disk - shared
        self.stats.disk_hit_tokens += disk
        self.stats.shared_hit_tokens += shared
        self.stats.admitted_tokens += req.num_tokens

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        out.scheduled = [s for s in out.scheduled if s.req is not req]

    # ---- after the step -------------------------------------------------------------------------

    def settle(self, out: SchedulerOutput, reports: list[StepReport]) -> set[int]:
        """After the step ran on every rank, first (then ``advance``): the ranks' acks (a load
        that landed lets its request run). Returns the batch indices whose computed tokens do
        not count: requests that computed beside their load, where the load failed or is not
        yet acked by every rank (a late or lost ack: the request waits for it and computes those
        tokens again). Only a load that lands in these very reports counts: a request whose load
        was cancelled while a step planned ahead ran (``reset_offload``) may already run again,
        admitted afresh, and those tokens are not its."""
        landed = self.process_reports(reports)
        return {
            i for i, item in enumerate(out.scheduled) if item.loading and item.req not in landed
        }

    def advance(
        self,
        out: SchedulerOutput,
        sampled: dict[int, tuple[int, bool]],
        void: AbstractSet[int] = frozenset(),
    ) -> list[Request]:
        """Each scheduled request's progress (but those in ``void``), and the token it sampled
        (``sampled``: batch index -> (token, is EOS)). Returns the requests that finished."""
        finished: list[Request] = []
        for i, item in enumerate(out.scheduled):
            if i in void:
                continue
            req = item.req
            self._count_computed(req, item.num_tokens)
            self.kv.publish(req)
            if i in sampled and self._take_token(req, *sampled[i]):
                finished.append(req)
        return finished

    def _count_computed(self, req: Request, num_tokens: int) -> None:
        start = req.num_computed
        req.num_computed += num_tokens
        self._note_computed(req, start, req.num_computed)

    def _take_token(self, req: Request, token: int, eos: bool) -> bool:
        """The request's newly sampled token; whether it ended the request (EOS, max_tokens)."""
        req.tokens.append(token)
        if eos:
            self.finish(req, RequestStatus.FINISHED_STOPPED)
        elif len(req.output) >= req.max_tokens:
            self.finish(req, RequestStatus.FINISHED_LENGTH)
        else:
            return False
        return True

    def commit(self, out: SchedulerOutput, sampling: AbstractSet[int]) -> None:
        """Async scheduling: count a planned step's tokens as computed now, so the next step
        can be planned while this one runs; ``sampling``: the batch indices that sample, each a
        token pending for its request until ``resolve``. Loads computing in their own step are
        left to ``resolve``: their tokens count only once every rank has acked the load."""
        for i, item in enumerate(out.scheduled):
            if item.loading:
                continue
            self._count_computed(item.req, item.num_tokens)
            if i in sampling:
                item.req.num_pending += 1

    def resolve(
        self,
        out: SchedulerOutput,
        sampling: AbstractSet[int],
        sampled: dict[int, tuple[int, bool]],
        void: AbstractSet[int] = frozenset(),
    ) -> list[Request]:
        """Async scheduling's ``advance`` for a step ``commit`` counted when it was planned: its
        sampled tokens join their requests (also one preempted since, whose token is as good as
        in a synchronous run), loads computing in their step count their tokens now, and the
        requests that ended are returned. A request aborted meanwhile takes nothing."""
        finished: list[Request] = []
        for i, item in enumerate(out.scheduled):
            req = item.req
            if item.loading:
                if i in void:
                    continue
                self._count_computed(req, item.num_tokens)
            elif i in sampling:
                req.num_pending -= 1
            if req.finished:
                continue
            if req.status is RequestStatus.RUNNING:
                self.kv.publish(req)
            if i in sampled and self._take_token(req, *sampled[i]):
                finished.append(req)
        return finished

    def process_reports(self, reports: list[StepReport]) -> set[Request]:
        """Count the ranks' acks; the loads that ended let their requests run, or start over.
        Returns the requests whose load landed and that run now."""
        landed: set[Request] = set()
        if self.connector is None:
            return landed
        for load in self.connector.process_reports(reports):
            req = self._finish_load(load.req, load.ok)
            if req is None or req.finished:
                continue
            if load.ok:
                self.kv.publish(req)
                landed.add(req)
            else:
                self.connector.release_blocks(req)  # it starts over, in new blocks
        return landed

    def _finish_load(self, req: Request, ok: bool) -> Request | None:
        """A load ended. On success the request runs on from after the loaded tokens. On failure
        it gives its blocks back and waits to be admitted again (its blocks were laid out for
        resuming after the load: a sliding-window group holds none before that window), so it
        recomputes from whatever the GPU prefix cache then still holds."""
        if req not in self.loading:
            return None
        self.loading.remove(req)
        if req.status is RequestStatus.FINISHED_ABORTED:
            self.kv.free(req)  # its blocks were kept until the load stopped writing them
            return req
        req.load_job = None
        if ok:
            req.loaded_s = time.perf_counter()
            req.num_computed += req.load_tokens
            req.load_tokens = 0
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            return req
        req.load_tokens = 0
        self.kv.free(req)
        req.num_computed = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        return req

    def _note_computed(self, req: Request, start: int, end: int) -> None:
        """Count tokens computed a second time (after a preemption or a failed load)."""
        prev = req.max_computed
        self.stats.recomputed_tokens += max(0, min(end, prev) - start)
        req.max_computed = max(prev, end)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request and free its blocks (an in-flight load keeps them until it lands); the
        connector decides what its transfers still need (a last store, or nothing)."""
        req.status = status
        if req not in self.loading:
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self.kv.free(req)
        if self.connector is not None:
            self.connector.request_finished(req)

    # ---- recovery and maintenance ---------------------------------------------------------------

    def silent_ranks(self, step: int, timeout_steps: int) -> list[int]:
        """Ranks that have not acked a job for ``timeout_steps`` steps (to be declared dead)."""
        return [] if self.connector is None else self.connector.silent_ranks(step, timeout_steps)

    def restart_all(self, keep_tier: bool) -> None:
        """A rank's KV is gone: every job in flight is abandoned (the CPU tier kept only when
        ``keep_tier``), the GPU prefix cache is forgotten, and every request with KV on the GPU
        gives its blocks back and waits to recompute from scratch."""
        if self.connector is not None:
            self.connector.reset(keep_tier=keep_tier)
        for req in self.waiting:
            req.num_pending = 0  # preempted while a lost step sampled for it
        moved: list[Request] = []
        for req in [*self.running, *self.loading]:
            req.num_pending = 0  # the steps in flight are lost: their tokens are recomputed
            self.kv.free(req)
            if req.status is RequestStatus.FINISHED_ABORTED:
                continue  # its load was what kept it
            req.num_computed = 0
            req.load_tokens = 0
            req.load_job = None
            req.status = RequestStatus.PREEMPTED
            req.num_preemptions += 1
            moved.append(req)
            if self.connector is not None:
                self.connector.release_blocks(req)
        self.running.clear()
        self.loading.clear()
        self.kv.forget_rank_tables()
        for req in sorted(moved, key=lambda r: r.index, reverse=True):
            self.waiting.appendleft(req)
        self.pool.reset_cache()

    def reset_offload(self) -> None:
        """Empty the CPU tier. Loads in flight are abandoned and their requests recompute."""
        if self.connector is None:
            return
        for cancelled in self.connector.reset():
            req = self._finish_load(cancelled, ok=False)
            if req is not None and not req.finished:
                self.connector.release_blocks(req)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.connector is not None:
            self.connector.check_invariants()
            self.connector.directory.check_invariants()
