"""EngineCore: one step is schedule (with the step's transfers) -> execute on every rank ->
update, plus recovery when a rank fails.

The loop never blocks on a transfer: while jobs are in flight and nothing is runnable, steps keep
going with an empty batch, polling and acking. A worker blocks only to flush a job whose blocks
are about to be overwritten, and on an empty step for at most ``worker.IDLE_WAIT_S`` to let a copy
land instead of spinning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from raykv.config import RaykvConfig
from raykv.connector.scheduler import ConnectorScheduler
from raykv.connector.worth import TierCosts
from raykv.core.block_pool import BlockPool
from raykv.core.hashing import parent_hash
from raykv.core.keys import key_group, key_hash
from raykv.core.kv_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, MEDIUM_SHARED, EventLog
from raykv.core.kv_groups import GroupKind, KVGroup
from raykv.core.request import Request, RequestRefused, RequestStatus
from raykv.core.step import (
    SAMPLE_FAILED,
    BlockContent,
    SamplingError,
    StepPlan,
    StepReport,
    TokenLogprobs,
    TransferStats,
)
from raykv.engine.batch import fill_pending, model_batch, pending_entries
from raykv.engine.disk_tier import WarmStart, disk_directory, reserve_slots, warm_start
from raykv.engine.latency import RECENT_REQUESTS, LatencyBook
from raykv.engine.ranks import RankFailed, StepHandle, Workers
from raykv.engine.sampler import real_model_tokens, sample_batch
from raykv.engine.scheduler import Scheduler
from raykv.engine.shared_tier import shared_directory, store_index_of, write_back
from raykv.engine.step_output import EngineTotals, PlannedStep, SchedulerOutput
from raykv.offload.directory import Directory

log = logging.getLogger(__name__)


class EngineCore:
    """The engine in one process. ``workers`` runs each step's plan on every rank."""

    def __init__(
        self,
        cfg: RaykvConfig,
        workers: Workers,
        *,
        offload: bool | None = None,
        verify: bool | None = None,
        directory: Directory | None = None,
        keep_finished: bool | None = None,
    ) -> None:
        self.cfg = cfg
        # a real model's stop tokens (``configure`` puts the checkpoint's EOS tokens there); the
        # synthetic model decides EOS itself
        self.stop_token_ids = frozenset(cfg.model.stop_token_ids)
        # False: forget requests once done (long runs keep only their outputs)
        self.keep_finished = cfg.engine.keep_finished if keep_finished is None else keep_finished
        self.workers = workers
        self.groups = [
            KVGroup(i, GroupKind(g.kind), g.window_tokens) for i, g in enumerate(cfg.cache.groups)
        ]
        self.block_size = cfg.cache.block_size
        # one KV-event stream for the GPU prefix cache and the CPU tier (a directory handed in
        # brings its own log, which the pool then records into)
        self.events = directory.events if directory is not None else EventLog(cfg.offload.events)
        self.pool = BlockPool(cfg.cache.num_gpu_blocks, self.events)
        use_offload = cfg.offload.enabled if offload is None else offload
        self.connector: ConnectorScheduler | None = None
        self.disk_start = WarmStart()  # what the disk tier's files held at start
        if use_offload:
            o = cfg.offload
            checked = cfg.offload.verify if verify is None else verify
            if directory is None:
                directory = Directory(
                    cfg.cpu_slots(),
                    o.policy,
                    store_threshold=o.store_threshold,
                    max_tracker_size=o.max_tracker_size,
                    events=self.events,
                )
            self.directory = directory
            disk = disk_directory(cfg, self.events)
            self.connector = ConnectorScheduler(
                self.directory,
                self.groups,
                self.block_size,
                o.blocks_per_chunk,
                workers.num_ranks,
                # the synthetic model's byte checks; any model's checksums of loaded chunks
                verify=checked and cfg.model.path is None,
                max_wait_s=cfg.engine.max_wait_s,
                ack_timeout_steps=cfg.engine.ack_timeout_steps,
                check_sums=checked,
                load_in_step=cfg.load_in_step(),
                disk=disk,
                cpu_reserve=(reserve_slots(cfg) if disk is not None or write_back(cfg) else 0),
                retry_full_steps=o.disk.retry_full_steps,
                shared=shared_directory(cfg, self.events),
                store_index=store_index_of(cfg, workers),
                shared_retry_steps=o.shared.retry_steps,
                shared_write_back=write_back(cfg),
                costs=(
                    TierCosts(
                        cfg.engine.max_num_batched_tokens,
                        load_in_step=cfg.load_in_step(),
                        ack_steps=2 if cfg.engine.async_scheduling else 1,
                    )
                    if o.take_hits == "faster"
                    else None
                ),
            )
            if disk is not None and self.connector.moves is not None:
                self.disk_start = warm_start(cfg, disk, workers)
                self.connector.moves.drop_files(self.disk_start.drop)
                self.disk_start.drop = []
        self.scheduler = Scheduler(
            self.pool,
            self.groups,
            self.block_size,
            cfg.engine.max_num_seqs,
            cfg.engine.max_num_batched_tokens,
            self.connector,
            policy=cfg.engine.schedule_policy,
            max_bypass_steps=cfg.engine.max_bypass_steps,
            short_prefill_alone=cfg.engine.short_prefill_alone,
        )
        # async scheduling: the next step is planned while the ranks run this one, its
        # decodes' input tokens written in once this one answers (``engine/batch.py``)
        self.async_scheduling = cfg.engine.async_scheduling
        self._in_flight: tuple[PlannedStep, StepHandle] | None = None
        self.requests: dict[str, Request] = {}
        self.totals = EngineTotals()
        self.latency = LatencyBook(
            samples=cfg.engine.latency_samples,
            max_records=None if self.keep_finished else RECENT_REQUESTS,
        )
        self.on_finished: Callable[[Request], None] | None = None

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self.check_request(req)
        if req.eos_token is None:
            req.eos_token = self.cfg.model.vocab_size - 1
        self.scheduler.add(req)
        self.latency.arrived(req)
        self.requests[req.req_id] = req
        self.totals.prompt_tokens += req.num_prompt

    def check_request(self, req: Request) -> None:
        """ValueError naming what is wrong with ``req`` if this engine would refuse it (an id
        in use, a token id outside the vocabulary, longer than the model's context or than
        the GPU pool can ever hold); nothing changes."""
        if req.req_id in self.requests:
            raise RequestRefused(f"duplicate request id {req.req_id!r}", "request_id")
        vocab = self.cfg.model.vocab_size
        # an int, not a bool or a float that compares like one: the step message carries ints
        bad = next((t for t in req.prompt if type(t) is not int or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRefused(f"request {req.req_id}: token id {bad} outside [0, {vocab})")
        limit = self.cfg.model.max_positions
        if limit is not None and req.num_prompt + req.max_tokens > limit:
            raise RequestRefused(
                f"request {req.req_id}: {req.num_prompt} prompt + {req.max_tokens} output tokens "
                f"exceed the model's context of {limit}",
                "max_tokens" if req.num_prompt < limit else "prompt",
            )
        if req.sampling is not None:
            try:
                req.sampling.check()
            except SamplingError as exc:
                raise RequestRefused(f"request {req.req_id}: {exc}", exc.field) from None
        self.scheduler.check_fits(req)

    def abort(self, req_id: str) -> None:
        """Stop a request now. A request still loading keeps its blocks until the load lands."""
        req = self.requests.get(req_id)
        if req is None or req.finished:
            return
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self._done(req)

    def has_work(self) -> bool:
        return (
            self._in_flight is not None
            or self.scheduler.has_unfinished()
            or self.scheduler.has_pending_transfers()
        )

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it. With async scheduling the
        step that runs is the one planned (and sent) by the call before, and the next is
        planned while it runs."""
        if self.async_scheduling:
            return self._step_ahead()
        started = time.perf_counter()
        planned = self._schedule()
        sched, plan = planned.sched, planned.plan
        try:
            reports = self.workers.execute(plan)
        except RankFailed as failure:
            # the step's tokens are lost with the rank: everything is recomputed anyway
            self._absorb(failure.reports)
            self.recover(failure.dead)
            if self.connector is not None:
                self.connector.carry_drops(plan.transfers)
            return []
        finished = self._update(sched, plan, reports)
        self._timed(started, reports, bool(sched.scheduled))
        silent = self.scheduler.silent_ranks(plan.step, self.cfg.engine.rank_timeout_steps)
        if silent:
            self.recover(silent)
        return finished

    def _step_ahead(self) -> list[Request]:
        """Async scheduling's step. The next step is planned before this one's replies are in,
        as if every token this one computes were computed (``Scheduler.commit``): it sees this
        step's acks one step late (a landed load runs a step later), and a request that samples
        its end here may compute one wasted token there. It is sent only after this one has
        answered and been absorbed, its pending tokens filled in, so the ranks never hold two
        steps and a failure loses just the unsent plan (recovery starts over anyway)."""
        started = time.perf_counter()
        current, handle = self._in_flight or self._send(self._schedule())
        self._in_flight = None
        busy = self.scheduler.has_unfinished() or self.scheduler.has_pending_transfers()
        ahead = self._schedule() if busy else None
        try:
            reports = handle.result()
        except RankFailed as failure:
            self._absorb(failure.reports)
            self.recover(failure.dead)
            if self.connector is not None:
                self.connector.carry_drops(current.plan.transfers)
            self._drop(ahead)
            return []
        finished = self._update(current.sched, current.plan, reports, current.sampling)
        self._timed(started, reports, bool(current.sched.scheduled))
        step = current.plan.step
        silent = self.scheduler.silent_ranks(step, self.cfg.engine.rank_timeout_steps)
        if silent:
            self.recover(silent)
            self._drop(ahead)
        elif ahead is not None:
            fill_pending(ahead.plan.batch, ahead.sched.scheduled, ahead.pending)
            self._in_flight = self._send(ahead)
        return finished

    def _drop(self, planned: PlannedStep | None) -> None:
        """Forget a plan made ahead that will never be sent (the recovery has just reset what
        it counted); the jobs it was to flush are flushed by the next plan instead."""
        if planned is not None and self.connector is not None:
            self.connector.carry_flushes(planned.plan.transfers)

    def _send(self, planned: PlannedStep) -> tuple[PlannedStep, StepHandle]:
        return planned, self.workers.submit(planned.plan)

    def _timed(self, started: float, reports: list[StepReport], busy: bool) -> None:
        """A step's wall time into the totals; ``busy``: it computed tokens (not one of
        ``idle_steps``), so the crossover's prior counts it too."""
        seconds = time.perf_counter() - started
        self.totals.step_seconds += seconds
        if busy:
            self.totals.busy_step_seconds += seconds
            costs = self.connector.costs if self.connector is not None else None
            if costs is not None:
                costs.observe_duration(seconds)
        if reports:
            busiest = max(reports, key=lambda r: r.busy_s)
            self.totals.ranks_busy_seconds += busiest.busy_s
            self.totals.ranks_model_seconds += busiest.model_s

    def _schedule(self) -> PlannedStep:
        sched = self.scheduler.schedule(self.totals.steps)
        kv = self.scheduler.kv
        batch = model_batch(sched.scheduled, kv, parent_hashes=self.cfg.model.path is None)
        plan = StepPlan(sched.step, sched.transfers, batch, kv.take_forgotten(), kv.tables_epoch)
        self.totals.steps += 1
        if not sched.scheduled:
            self.totals.idle_steps += 1
        if not self.async_scheduling:
            return PlannedStep(sched, plan)
        sampling = frozenset(i for i, entry in enumerate(batch) if entry.samples)
        planned = PlannedStep(sched, plan, pending_entries(sched.scheduled), sampling)
        self.scheduler.commit(sched, sampling)
        return planned

    def _update(
        self,
        sched: SchedulerOutput,
        plan: StepPlan,
        reports: list[StepReport],
        committed: frozenset[int] | None = None,
    ) -> list[Request]:
        """The step's replies into the books; ``committed``: the step was counted when planned
        (async scheduling), these entries sampling."""
        self._absorb(reports)
        if self.connector is not None and self.connector.costs is not None:
            load_in_step = self.connector.load_in_step
            costs = self.connector.costs
            costs.observe_reports(sched.num_tokens, sched.attention, reports, load_in_step)
        void = self.scheduler.settle(sched, reports)
        m = self.cfg.model
        logprobs: dict[int, TokenLogprobs] = {}
        if m.path is not None:
            sampled, logprobs = real_model_tokens(plan.batch, reports, self.stop_token_ids)
        else:
            sampled = sample_batch(plan.batch, reports, m.vocab_size, m.eos_every)
        # tokens that do not count: a load that did not land beside them, or (a step planned
        # ahead) a request that ended or was aborted while the step ran
        ended = {i for i in sampled if sched.scheduled[i].req.finished}
        self.totals.discarded_samples += len(ended)
        lost = set(void) | ended
        for i in lost:
            sampled.pop(i, None)
        for i, found in logprobs.items():
            if i not in lost:
                sched.scheduled[i].req.logprobs.append(found)
        # a sample a rank could not draw ends its request as an EOS would (the way every path,
        # a step planned ahead included, already knows), then counts as the error it is
        failed = {i for i, (token, _) in sampled.items() if token == SAMPLE_FAILED}
        for i in failed:
            sampled[i] = (SAMPLE_FAILED, True)
        self.totals.generated_tokens += len(sampled) - len(failed)
        self.totals.failed_requests += len(failed)
        now = self.latency.clock()
        for i in sampled.keys() - failed:
            self.latency.sampled(sched.scheduled[i].req, now)
        if committed is None:
            finished = self.scheduler.advance(sched, sampled, void)
        else:
            finished = self.scheduler.resolve(sched, committed, sampled, void)
        for i in failed:
            req = sched.scheduled[i].req
            if req.finished and req.tokens[-1] == SAMPLE_FAILED:
                req.tokens.pop()  # no token came: the output ends before it
                req.status = RequestStatus.FINISHED_ERROR
        for req in finished:
            self._done(req)
        return finished

    def recover(self, dead: list[int]) -> None:
        """Replace dead ranks and start over from what survives. The new ranks hold no KV, so
        the GPU prefix cache is forgotten and every request with KV on the GPU recomputes it;
        every job in flight is abandoned (flushed by the next step, late acks ignored as stale).
        The CPU tier keeps its finished chunks when every new rank found its predecessor's
        CPU-pool shard (``offload.shared_pool``); otherwise each chunk lost a shard and the tier
        is emptied. The model is deterministic, so each request still produces exactly its
        fault-free tokens."""
        self.totals.rank_restarts += len(dead)
        intact = self.workers.restart(dead)
        if self.connector is not None and intact:
            self.totals.tier_kept_restarts += len(dead)
        self.scheduler.restart_all(keep_tier=intact)

    def _absorb(self, reports: list[StepReport]) -> None:
        per_rank = self.totals.per_rank
        while len(per_rank) < self.workers.num_ranks:
            per_rank.append(TransferStats())
        for report in reports:
            self.totals.transfer.add(report.transfers.stats)
            per_rank[report.rank].add(report.transfers.stats)

    def _done(self, req: Request) -> None:
        self.totals.finished += 1
        if not self.keep_finished:
            self.requests.pop(req.req_id, None)
        if self.on_finished is not None:
            self.on_finished(req)

    # ---- maintenance ----------------------------------------------------------------------

    def reset_prefix_cache(self) -> None:
        """Forget the GPU prefix cache: later requests find nothing on the GPU (blocks in use
        keep their contents; the CPU tier is untouched)."""
        self.pool.reset_cache()

    def spill_to_disk(self, timeout_s: float | None = None) -> int:
        """Move every chunk of the CPU tier that nobody reads to the disk tier and wait until
        they have landed, or ``timeout_s`` has passed (nothing without a disk tier): the chunks
        it demoted. Not while requests run (a graceful stop's spill steps only while demotions
        are in flight; requests still queued or running are left as they are)."""
        moves = self.connector.moves if self.connector is not None else None
        if moves is None:
            return 0
        before = moves.stats.demoted
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        moves.spill()
        self.step()
        while self.has_work():
            if deadline is not None and (
                time.monotonic() >= deadline or not self.connector.moves_in_flight()
            ):
                break
            self.step()
        return moves.stats.demoted - before

    def stop(self) -> int:
        """A graceful stop: the CPU tier spilled to the disk tier for at most
        ``offload.disk.spill_on_stop_s`` (what a later engine on the path starts warm with;
        what is still being written then lands as the ranks' disk engines shut down, and is
        found by the next engine's warm start if every rank's part is whole). The chunks
        spilled."""
        d = self.cfg.offload.disk
        if not (self.cfg.offload.enabled and d.enabled) or d.spill_on_stop_s <= 0:
            return 0
        spilled = self.spill_to_disk(d.spill_on_stop_s)
        if spilled:
            log.info("graceful stop: %d chunks of the CPU tier written to the disk tier", spilled)
        return spilled

    def kv_state(self) -> tuple[int, dict[str, list[int]]]:
        """What the KV events have announced so far, as a whole: (the next event's sequence
        number, the keys each medium holds). A consumer that missed events starts again from
        this and the events from that number on."""
        held = {MEDIUM_GPU: self.pool.cached_keys()}
        if self.connector is not None:
            held[MEDIUM_CPU] = list(self.directory.readable_keys())
            if self.connector.moves is not None:
                held[MEDIUM_DISK] = list(self.connector.moves.disk.readable_keys())
            if self.connector.shared_moves is not None:
                held[MEDIUM_SHARED] = list(self.connector.shared_moves.shared.readable_keys())
        return self.events.next_seq, held

    def reset_offload(self) -> None:
        """Empty the CPU tier (e.g. after a model swap). Loads in flight are abandoned: their
        requests recompute; every job still in flight is flushed by the next step."""
        self.scheduler.reset_offload()

    def cpu_tier_contents(
        self, requests: Iterable[Request] | None = None
    ) -> list[tuple[int, int, BlockContent]]:
        """(slot, position in chunk, expected content) of every block of every readable chunk,
        from the requests whose hash chains produced them (by default the engine's own, which
        are all of them unless finished ones are forgotten): what ``verify_cpu_tier`` on each
        rank compares the pool with."""
        if self.connector is None:
            return []
        where: dict[int, tuple[Request, int]] = {}
        for req in self.requests.values() if requests is None else requests:
            for b, h in enumerate(req.hashes):
                where.setdefault(h, (req, b))
        d, bs = self.directory, self.block_size
        bpc = self.cfg.offload.blocks_per_chunk
        out = []
        for key in d.readable_keys():
            req, last = where[key_hash(key)]
            for sub in range(bpc):
                b = last - bpc + 1 + sub
                tokens = tuple(req.tokens[b * bs : (b + 1) * bs])
                content = BlockContent(
                    key_group(key), parent_hash(req.hashes, b, req.root_hash), tokens
                )
                out.append((d.slot_of(key), sub, content))
        return out

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
