"""The connector's scheduler half: what to load, what to store, what to flush, and the books.

It never touches tensors, and its only caller is the engine scheduler, in the protocol's order:
``lookup`` (how much of a waiting request the tiers can supply, ``connector/lookup.py``),
``on_allocated`` / ``on_released`` (every GPU block allocation and sliding-window release, from
every path; an admission with a hit brings its load), ``plan`` (the step's flushes, loads and
stores, and the lower tiers' moves), ``process_reports`` (the ranks' acks), ``request_finished``
and ``reset``. Per-request state and its changes are ``connector/state.py``'s; the moves between
the CPU tier and the tiers below it, ``connector/tier_moves.py``'s (disk) and
``connector/shared_moves.py``'s (shared store), planned together by ``connector/lower_tiers.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from raykv.connector.fence import Fence, FenceError
from raykv.connector.invariants import check_connector
from raykv.connector.jobs import JobTable, TransferJobStatus
from raykv.connector.lookup import PrefixLookup
from raykv.connector.lower_tiers import LowerTiers
from raykv.connector.scheduled import FinishedLoad, ScheduledRequest
from raykv.connector.shared_moves import StoreIndex
from raykv.connector.state import ReleasedBlocks, RequestOffloadState
from raykv.connector.stats import ConnectorStats
from raykv.connector.worth import TierCosts
from raykv.core.kv_groups import KVGroup
from raykv.core.request import Request
from raykv.core.step import BlockCopy, StepReport, TransferPlan, TransferSpec
from raykv.offload.directory import Directory


class ConnectorScheduler:
    """The scheduler half of the offloading connector.

    Args:
        directory: the CPU tier.
        groups: the KV groups, in table order.
        block_size: tokens per GPU block.
        blocks_per_chunk: GPU blocks per CPU chunk.
        num_ranks: ranks that must each acknowledge every job.
        verify: attach the expected content of each loaded block to load jobs.
        check_sums: have the ranks check every loaded chunk's checksum before copying it; a
            corrupt chunk fails its load and leaves the tier.
        load_in_step: every load is finished by each rank before that step's model runs, so
            its request can compute in the step that loads it (``TransferSpec.same_step``).
        max_wait_s: seconds a request may wait for the tiers, in all, before it takes what is
            readable or recomputes (``connector/lookup.py``).
        ack_timeout_steps: steps a job may go unacked before the ranks are asked again.
        disk: the disk tier.
        cpu_reserve: the CPU slots kept free ahead of need by the disk's demotions, or by the
            shared tier's write-back publishes where there is no disk tier.
        shared: the shared tier's index of the store, ``store_index`` the store's answers;
            ``shared_write_back``: publish chunks as they leave the CPU tier (else as they reach
            it).
        costs: the measured costs that decide which hits are worth loading (None: all are).
    """

    def __init__(
        self,
        directory: Directory,
        groups: Sequence[KVGroup],
        block_size: int,
        blocks_per_chunk: int,
        num_ranks: int,
        verify: bool = False,
        max_wait_s: float = 5.0,
        ack_timeout_steps: int = 32,
        check_sums: bool = False,
        load_in_step: bool = False,
        disk: Directory | None = None,
        cpu_reserve: int = 0,
        retry_full_steps: int = 512,
        costs: TierCosts | None = None,
        shared: Directory | None = None,
        store_index: StoreIndex | None = None,
        shared_retry_steps: int = 512,
        shared_write_back: bool = False,
    ) -> None:
        self.directory = directory
        self.load_in_step = load_in_step
        self.groups = list(groups)
        self.block_size = block_size
        self.bpc = blocks_per_chunk
        self.tpc = block_size * blocks_per_chunk
        self.verify = verify
        self.check_sums = check_sums
        self._corrupt: set[int] = set()  # jobs a rank found corrupt, until they finalize
        self._full: set[int] = set()  # demotions a rank found the disk full for
        self._unsettled: set[int] = set()  # promotions whose failed reads may still land
        # per move, the keys a rank found bad at their source, until it finalizes
        self._bad_keys: dict[int, set[int]] = {}
        self.ack_timeout_steps = ack_timeout_steps
        self.step = 0  # the step being scheduled: jobs created now belong to it
        self.jobs = JobTable(num_ranks)
        self.fence = Fence()
        self.stats = ConnectorStats()
        self.lower = LowerTiers.build(
            directory, self.jobs, check_sums, cpu_reserve, (disk, retry_full_steps),
            (shared, store_index, shared_retry_steps, shared_write_back),
        )  # fmt: skip
        self.moves, self.shared_moves = self.lower.disk, self.lower.shared
        self._lookup = PrefixLookup(
            directory, groups, block_size, blocks_per_chunk, max_wait_s, self.stats
        )
        self._lookup.moves, self._lookup.shared_moves = self.moves, self.shared_moves
        self.costs = costs
        self._lookup.costs = costs
        # keyed by the request object: state belongs to one admission, never to an id (serving
        # forgets finished requests, and a new request may come with an old one's id)
        self._reqs: dict[Request, RequestOffloadState] = {}
        self._loading_keys: dict[int, int] = {}  # key -> loads in flight reading it
        self._allocated: set[int] = set()  # GPU blocks allocated this step
        self._released = ReleasedBlocks()
        self._flush: dict[int, str] = {}  # job -> why, for this step's plan
        self._loads: list[TransferSpec] = []
        self._finished: list[RequestOffloadState] = []  # finished since the last plan

    def _state(self, req: Request) -> RequestOffloadState:
        state = self._reqs.get(req)
        if state is None:
            state = RequestOffloadState.new(req, len(self.groups))
            self._reqs[req] = state
        return state

    # ---- lookups --------------------------------------------------------------------------

    def lookup(self, req: Request, num_local: int) -> int | None:
        """How many tokens after the ``num_local`` already on the GPU the tiers can supply.

        None means "ask again next step": the request has transfers in flight (one load xor
        stores, and a preempted request's flushed stores may not be acked yet), or the chunks it
        would load are still being written, or another request is already loading them (it will
        find them in the GPU prefix cache once that load lands).
        """
        return self._lookup.lookup(self._state(req), num_local, self._loading_keys)

    def peek(self, req: Request, num_local: int) -> int:
        """About how many tokens after ``num_local`` the CPU tier holds for ``req``, with no
        effect on the tier or the request (``PrefixLookup.peek``)."""
        return self._lookup.peek(self._state(req), num_local)

    def disk_tokens(self, req: Request, num_local: int, hit: int, shared: bool = False) -> int:
        """Of the ``hit`` tokens a load brings after ``num_local``, those promoted from the
        disk tier (``shared``: from the shared store) for this request."""
        state = self._reqs.get(req)
        return state.promoted_tokens(num_local, num_local + hit, self.tpc, shared) if state else 0

    def take_delays(self) -> tuple[list[float], list[float]]:
        """Lookup delays since the last call (see ``PrefixLookup.take_delays``)."""
        return self._lookup.take_delays()

    # ---- allocation feed ------------------------------------------------------------------

    def on_allocated(
        self,
        req: Request,
        new_entries: Sequence[Sequence[int]],
        fresh: Sequence[int],
        load_tokens: int = 0,
    ) -> None:
        """Every path that appends to a request's block tables reports here: the entries appended
        to each group's table (0 for positions that need no block), and which of them came fresh
        from the free pool (they will be written; revived prefix-cache blocks are only read).
        The fence is only as good as this feed. An admission with a CPU-tier hit says how many
        tokens after ``req.num_computed`` the load brings (what ``lookup`` answered); the load
        job is built now, into the blocks just allocated."""
        self._released.reallocated(fresh)
        state = self._state(req)
        for gs, entries in zip(state.groups, new_entries, strict=True):
            gs.block_ids.extend(entries)
        self._allocated.update(fresh)
        if load_tokens:
            self._start_load(state, req.num_computed, load_tokens)

    def on_released(self, req: Request, group: int, positions: Sequence[int]) -> None:
        """A running request gave back the blocks at ``positions`` of a sliding-window group's
        table (they left the window). One not yet stored stays storable until the pool hands it
        out again; one behind the store cursor is never needed again, so its entry is cleared
        (a reset rewinds the cursor: it must not find another owner's block there)."""
        state = self._reqs.get(req)
        if state is not None:
            self._released.release(state, group, positions, self.bpc)

    def _start_load(self, state: RequestOffloadState, num_local: int, num_external: int) -> None:
        """Build the load job for an admitted request whose blocks were just allocated."""
        req = state.req
        bs, bpc = self.block_size, self.bpc
        first, last = num_local // bs, (num_local + num_external) // bs
        blocks, chunk_keys, subs, expect = state.load_targets(first, last, bs, bpc, self.verify)
        unique = list(dict.fromkeys(chunk_keys))
        slot_of = dict(zip(unique, self.directory.prepare_load(unique), strict=True))
        job = self.jobs.create(req, unique, is_store=False, step=self.step)
        for key in unique:
            self._loading_keys[key] = self._loading_keys.get(key, 0) + 1
        state.add_job(job.job_id, is_store=False)
        for gs in state.groups:  # chunk-level: what was loaded is not stored again
            gs.next_stored_chunk = max(gs.next_stored_chunk, last // bpc)
        copy = BlockCopy(blocks, [slot_of[k] for k in chunk_keys], subs)
        self._loads.append(
            TransferSpec(job.job_id, False, copy, expect, self.check_sums, self.load_in_step)
        )
        self.stats.load_jobs += 1
        self.stats.load_blocks += len(blocks)

    # ---- the step plan ----------------------------------------------------------------------

    def plan(
        self, step: int, scheduled: Sequence[ScheduledRequest], preempted: Sequence[Request]
    ) -> TransferPlan:
        """The transfers for this step: flush first, then loads, then (after the model step)
        stores."""
        self.step = step
        for req in preempted:
            self._on_preempted(req)
        for job_id in self.fence.jobs_on(self._allocated):
            self._flush.setdefault(job_id, "reuse")
        self._nudge_overdue()
        stores: list[TransferSpec] = []
        for item in scheduled:
            state = self._reqs.get(item.req)
            # one load xor stores: what a request computes while its load lands is stored by
            # a later step's plan (the store cursor catches up then)
            if state is not None and not state.finished and not item.loading:
                self._build_store(state, item.req.num_computed + item.num_tokens, stores)
        for state in self._finished:
            self._build_store(state, state.req.num_computed, stores)
            state.finished_signaled = True  # no more submits for it after this point
            if state.forgettable:
                del self._reqs[state.req]
        self._finished = []
        for why in self._flush.values():
            key = f"flushes_{'timeout' if why == 'reack' else why}"
            setattr(self.stats, key, getattr(self.stats, key) + 1)
        flush = sorted(j for j, why in self._flush.items() if why != "reack")
        reack = sorted(j for j, why in self._flush.items() if why in ("timeout", "reack"))
        moves, disk_drops, shared_drops = self.lower.plan(step)
        plan = TransferPlan(flush, reack, self._loads, stores, moves, disk_drops, shared_drops)
        self._loads, self._flush, self._allocated = [], {}, set()
        # jobs created from now on (loads and promotions at admission) belong to the next
        self.step = step + 1
        self.lower.set_step(self.step)
        return plan

    def carry_flushes(self, plan: TransferPlan) -> None:
        """A plan that was built but never sent (async scheduling drops the plan made ahead
        when a rank fails): the flushes it carried go in the next plan, which is the one that
        must finish every abandoned job before its blocks and slots are used again (its loads
        and stores never ran: they are jobs the recovery has abandoned with the others)."""
        for job_id in plan.flush:
            self._flush.setdefault(job_id, "reset")
        self.carry_drops(plan)

    def carry_drops(self, plan: TransferPlan) -> None:
        """The disk files and store parts a plan had the ranks drop, dropped again by the next
        plan: a plan never sent dropped nothing, and a rank that died in one may not have."""
        self.lower.carry_drops(plan)

    def _nudge_overdue(self) -> None:
        """Jobs unacked for a while are flushed again: a rank that finished one but whose report
        was lost reports it once more; one still copying finishes it now. A move between the
        tiers is only asked again (a rank would wait on its disk I/O in the step)."""
        timeout, step = self.ack_timeout_steps, self.step
        for job in self.jobs.jobs.values():
            age = step - job.created_step
            if age >= timeout and age % timeout == 0:
                self._flush.setdefault(job.job_id, "reack" if job.move else "timeout")

    def silent_ranks(self, step: int, timeout_steps: int) -> list[int]:
        """Ranks that still have not acked a job after ``timeout_steps`` (to be declared dead)."""
        return self.jobs.silent_ranks(step, timeout_steps)

    def release_blocks(self, req: Request) -> None:
        """The request lost its GPU blocks outside a plan (a rank died and everything restarts)."""
        state = self._reqs.get(req)
        if state is not None:
            state.clear_blocks()

    def _on_preempted(self, req: Request) -> None:
        state = self._reqs.get(req)
        if state is None:
            return
        for job_id in state.jobs:
            job = self.jobs.jobs[job_id]
            assert job.is_store, f"request {req.req_id} preempted while loading"
            self._flush.setdefault(job_id, "preemption")
            # its blocks are free from now on: protect them like a finished request's
            self._fence_deferred(job)
        state.clear_blocks()

    def _build_store(
        self, state: RequestOffloadState, offloadable_tokens: int, out: list[TransferSpec]
    ) -> None:
        req, bpc = state.req, self.bpc
        state.update_keys(self.block_size, bpc)
        storable = min(offloadable_tokens // self.tpc, len(req.hashes) // bpc)
        wanted = state.unstored_chunks(storable, bpc)
        if not wanted:
            state.advance(storable, bpc)
            return
        plan = self.directory.prepare_store([k for _, _, k in wanted])
        # more chunks than the tier can make room for at once (a prompt longer than the CPU
        # tier, or most of it pinned): the longest prefix that fits, the rest from the next
        # steps, as demotions free room (a prompt was never stored at all, nor reached the disk).
        # The request's own chunks before these are kept: a lookup reaches a chunk only through
        # every one before it, so its prefix is never evicted for its suffix
        first = min(c for _, c, _ in wanted)
        if plan is None and storable - first > 1:
            own = [k for gs in state.groups for k in gs.keys[:first]]
            room = self.directory.room([*own, *(k for _, _, k in wanted)])
            storable = min(storable - 1, first + max(1, room // len(self.groups)))
            while plan is None and storable > first:
                wanted = [w for w in wanted if w[1] < storable]
                plan = self.directory.prepare_store([k for _, _, k in wanted], keep=own)
                storable = first + (storable - first) // 2 if plan is None else storable
        if plan is None:
            self.stats.allocation_failures += 1
            return  # keep the cursors: retried next step
        state.advance(storable, bpc)
        if not plan.keys:
            return
        slot_of = dict(zip(plan.keys, plan.slots, strict=True))
        sliding = [g.is_sliding for g in self.groups]
        blocks, slots, subs, fenced, deferred = state.store_targets(wanted, slot_of, bpc, sliding)
        if len(set(blocks)) != len(blocks):
            raise FenceError(f"request {req.req_id}: a GPU block appears twice in one store")
        job = self.jobs.create(req, list(plan.keys), True, fenced, deferred, self.step)
        self.fence.add(job.job_id, fenced)
        if state.finished:
            job.deferred_fenced = True
            if any(b in self._allocated for b in fenced):
                self._flush.setdefault(job.job_id, "reuse")  # new owner writes this step
        state.add_job(job.job_id, is_store=True)
        copy = BlockCopy(blocks, slots, subs)
        out.append(TransferSpec(job.job_id, True, copy, check_sums=self.check_sums))
        self.stats.store_jobs += 1
        self.stats.store_blocks += len(blocks)

    def _fence_deferred(self, job: TransferJobStatus) -> None:
        if not job.deferred_fenced:
            self.fence.add(job.job_id, job.deferred_fence_block_ids)
            job.deferred_fenced = True

    # ---- lifecycle ---------------------------------------------------------------------------

    def request_finished(self, req: Request) -> None:
        """The request ended (EOS, length or abort) and its blocks are being freed. Its stores in
        flight now protect their blocks through the fence; the next plan builds the store of its
        last full chunks, after which no more jobs are submitted for it. One that holds no
        blocks and has nothing in flight (aborted while queued) is forgotten at once."""
        state = self._reqs.get(req)
        if state is None:
            return
        if not state.jobs and not state.holds_blocks():
            del self._reqs[req]
            return
        state.finished = True
        for job_id in state.jobs:
            job = self.jobs.jobs[job_id]
            if job.is_store:
                self._fence_deferred(job)
        self._finished.append(state)

    def process_reports(self, reports: Iterable[StepReport]) -> list[FinishedLoad]:
        """Count every rank's acks; finalize jobs at full count. Returns the loads that ended."""
        done: list[FinishedLoad] = []
        for report in reports:
            t = report.transfers
            self._corrupt.update(t.corrupt)
            self._full.update(t.full)
            self._unsettled.update(t.unsettled)
            for job_id, keys in t.bad_keys.items():
                if job_id in self.jobs.jobs:  # a stale job's are dropped with it
                    self._bad_keys.setdefault(job_id, set()).update(keys.unpack())
            for ok, ids in ((True, t.completed), (False, t.failed)):
                for job_id in ids:
                    job = self.jobs.ack(job_id, report.rank, ok)
                    if job is not None:
                        load = self._finalize(job)
                        if load is not None:
                            done.append(load)
        return done

    def _finalize(self, job: TransferJobStatus) -> FinishedLoad | None:
        d = self.directory
        if self.costs is not None:
            self.costs.observe_job(job, self.bpc, self.load_in_step)
        if job.move:
            self._finalize_move(job)
            return None
        if job.is_store:
            d.complete_store(job.keys, success=not job.failed)
            self.stats.failed_stores += job.failed
            if not job.failed:
                self.lower.stored(job.keys)  # write-through to the shared tier
            self.fence.remove(job.job_id, job.fenced_block_ids)
            if job.deferred_fenced:
                self.fence.remove(job.job_id, job.deferred_fence_block_ids)
        else:
            d.complete_load(job.keys)
            self.stats.failed_loads += job.failed
            if job.job_id in self._corrupt:  # never served again: its request recomputes
                self._corrupt.discard(job.job_id)
                self.stats.corrupt_loads += 1
                d.discard(job.keys)
            for key in job.keys:
                n = self._loading_keys[key] - 1
                if n:
                    self._loading_keys[key] = n
                else:
                    del self._loading_keys[key]
        state = self._reqs.get(job.request)
        if state is not None:
            state.end_job(job.job_id, job.is_store)
            if job.failed and not job.is_store:
                state.load_failed = True
            if state.forgettable:
                del self._reqs[state.req]
        return None if job.is_store else FinishedLoad(job.request, not job.failed)

    def _finalize_move(self, job: TransferJobStatus) -> None:
        corrupt, full = job.job_id in self._corrupt, job.job_id in self._full
        unsettled = job.job_id in self._unsettled
        for flags in (self._corrupt, self._full, self._unsettled):
            flags.discard(job.job_id)
        bad = self._bad_keys.pop(job.job_id, set())
        self.lower.finalize(job, corrupt, full, unsettled, bad)

    def reset(self, keep_tier: bool = False) -> list[Request]:
        """Abandon every job; drop the CPU tier's contents unless ``keep_tier``.

        In-flight jobs are flushed by the next plan (a surviving rank may still be copying: its
        loads must land before their slots are handed to new stores, its stores before their
        slots are written again) and their late acks are ignored as stale. With ``keep_tier``
        (every rank's CPU-pool shard survived) each abandoned job ends as failed: a store's keys
        never become readable, a load's chunks are released; what was readable stays readable.
        Returns the requests whose loads were cancelled (to recompute)."""
        cancelled = [s.req for s in self._reqs.values() if s.has_load]
        for job in self.jobs.reset():
            self._flush[job.job_id] = "reset"
            self._bad_keys.pop(job.job_id, None)
            if job.move:
                self.lower.abandon(job, keep_cpu=keep_tier)
                continue
            if not keep_tier:
                continue
            if job.is_store:
                self.directory.complete_store(job.keys, success=False)
                self.stats.failed_stores += 1
            else:
                self.directory.complete_load(job.keys)
                self.stats.failed_loads += 1
        for req, state in list(self._reqs.items()):
            if state.finished:
                del self._reqs[req]
                continue
            state.rewind()
        self._finished = [s for s in self._finished if s.req in self._reqs]
        if not keep_tier:
            self.directory.reset()
        self.fence.clear()
        self._loading_keys.clear()
        return cancelled

    # ---- queries ---------------------------------------------------------------------------

    def has_pending_work(self) -> bool:
        """Keep stepping while this is true (jobs in flight or finished requests to close)."""
        return bool(self.jobs) or bool(self._finished) or bool(self._loads)

    def moves_in_flight(self) -> bool:
        """A move between the tiers (a demotion, promotion or publish) is not final yet."""
        return any(job.move for job in self.jobs.jobs.values())

    def tracked(self) -> int:
        return len(self._reqs)

    def in_flight(self, req: Request) -> set[int]:
        state = self._reqs.get(req)
        return set(state.jobs) if state else set()

    def check_invariants(self) -> None:
        """The scheduler-side invariants of DESIGN.md (fence, acks, one load xor stores)."""
        check_connector(self.jobs, self.fence, self._reqs, self.lower)
