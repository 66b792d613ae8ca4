"""A small driver for behaviour tests: a real engine, real connector, real CPU copies.

Runs every rank in-process with the unthreaded CPU transfer engine, so a copy happens only at a
step's poll or when a flush needs it, and ``pause_copies`` keeps submitted copies really pending
(not just unreported) until ``resume_copies``. Every plan is recorded and translated into request
block offsets at the moment it is built, so tests can say "offsets 0-2 of request A were stored
and flushed" as vLLM's scheduler tests do.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from raykv.config import load_config
from raykv.core.hashing import block_hashes
from raykv.core.keys import make_key
from raykv.core.request import Request
from raykv.core.step import StepPlan, StepReport, TransferPlan
from raykv.engine.core import EngineCore
from raykv.engine.workers import LocalWorkerGroup
from raykv.offload.directory import Directory

Offset = tuple[int, int]  # (KV group, block index within the request)


@dataclass
class StepRecord:
    plan: TransferPlan  # the step plan's transfer part
    stored: dict[str, list[Offset]] = field(default_factory=lambda: defaultdict(list))
    loaded: dict[str, list[Offset]] = field(default_factory=lambda: defaultdict(list))
    flushed: dict[str, list[Offset]] = field(default_factory=lambda: defaultdict(list))
    fence: set[int] = field(default_factory=set)
    gpu_blocks: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))


class Runner:
    def __init__(
        self,
        *,
        block_size: int = 4,
        num_gpu_blocks: int = 64,
        blocks_per_chunk: int = 1,
        groups: str = "[{kind: full_attention}]",
        tp: int = 1,
        cpu_slots: int = 64,
        policy: str = "lru",
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        directory: Directory | None = None,
        faults: tuple[str, ...] = (),
        exec_delays: dict | None = None,
        offload: bool = True,
        keep_finished: bool = True,
        store_threshold: int = 0,
        max_wait_s: float = 5.0,
        load_in_step: bool = False,
        settings: tuple[str, ...] = (),
    ) -> None:
        n_groups = groups.count("kind")
        self.cfg = load_config(
            None,
            [
                f"cache.block_size={block_size}",
                f"cache.num_gpu_blocks={num_gpu_blocks}",
                f"cache.groups={groups}",
                f"model.num_layers={n_groups}",
                f"model.num_kv_heads={2 * tp}",
                "model.head_dim=4",
                f"parallel.tensor_parallel_size={tp}",
                f"offload.blocks_per_chunk={blocks_per_chunk}",
                f"offload.cpu_slots={cpu_slots}",
                f"offload.policy={policy}",
                f"engine.max_num_seqs={max_num_seqs}",
                f"engine.max_num_batched_tokens={max_num_batched_tokens}",
                f"offload.store_threshold={store_threshold}",
                f"engine.max_wait_s={max_wait_s}",
                f"offload.load_in_step={'true' if load_in_step else 'false'}",
                "faults=[" + ",".join(f'"{f}"' for f in faults) + "]",
                # every hit loaded: the protocol is what these tests drive, not the choice of
                # hits (tests/connector/test_worth.py), which on this tiny synthetic model would
                # recompute them all
                "offload.take_hits=always",
                *settings,
            ],
        )
        self.workers = LocalWorkerGroup(
            self.cfg, cpu_slots, exec_delays=exec_delays, threaded=False
        )
        self.engine = EngineCore(
            self.cfg,
            self.workers,
            offload=offload,
            verify=True,
            directory=directory,
            keep_finished=keep_finished,
        )
        self.connector = self.engine.connector
        self.records: list[StepRecord] = []
        self._job_offsets: dict[int, tuple[str, list[Offset]]] = {}
        self._next_index = 0
        self.reports: list[list[StepReport]] = []
        execute = self.workers.execute

        def recording_execute(plan: StepPlan) -> list[StepReport]:
            self.records.append(self._record(plan))
            reports = execute(plan)
            self.reports.append(reports)
            return reports

        self.workers.execute = recording_execute  # type: ignore[method-assign]

    # ---- driving ------------------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 1) -> Request:
        req = Request(req_id, self._next_index, list(prompt), max_tokens)
        self._next_index += 1
        self.engine.add_request(req)
        return req

    def step(self, n: int = 1) -> list[Request]:
        finished = []
        for _ in range(n):
            finished += self.engine.step()
            self.engine.check_invariants()
        return finished

    def run(self, max_steps: int = 500) -> None:
        """Step until every request is done and every job acked (the non-blocking drain)."""
        for _ in range(max_steps):
            if not self.engine.has_work():
                return
            self.step()
        raise AssertionError(f"not drained after {max_steps} steps")

    def pause_copies(self, ranks: list[int] | None = None) -> None:
        for w in self.workers.workers:
            if ranks is None or w.rank in ranks:
                w.engine.pause()

    def resume_copies(self) -> None:
        for w in self.workers.workers:
            w.engine.resume()

    def close(self) -> None:
        self.workers.shutdown()

    # ---- what happened ------------------------------------------------------------------

    def state(self, req_id: str):
        """The connector's state for the live request with this id (the newest one)."""
        assert self.connector is not None
        found = [s for req, s in self.connector._reqs.items() if req.req_id == req_id]
        assert found, f"no connector state for {req_id}"
        return found[-1]

    def in_flight(self, req_id: str) -> set[int]:
        """Jobs in flight of every tracked request with this id."""
        assert self.connector is not None
        states = self.connector._reqs.items()
        return {j for req, state in states if req.req_id == req_id for j in state.jobs}

    def _offsets(self, req: Request, blocks: list[int]) -> list[Offset]:
        req_id = req.req_id
        state = self.connector._reqs[req]
        out = []
        for b in blocks:
            found = [
                (g, i)
                for g, gs in enumerate(state.groups)
                for i, x in enumerate(gs.block_ids)
                if x == b
            ]
            assert len(found) == 1, f"block {b} of {req_id} at {found}"
            out.append(found[0])
        return out

    def _record(self, step_plan: StepPlan) -> StepRecord:
        plan = step_plan.transfers
        rec = StepRecord(plan, fence=self.connector.fence.blocks() if self.connector else set())
        if self.connector is None:
            return rec
        jobs = self.connector.jobs.jobs
        for spec, into in [(s, rec.stored) for s in plan.stores] + [
            (s, rec.loaded) for s in plan.loads
        ]:
            owner = jobs[spec.job_id].request
            req_id = owner.req_id
            offsets = self._offsets(owner, spec.copy.gpu_blocks)
            rec.gpu_blocks[req_id].update(spec.copy.gpu_blocks)
            self._job_offsets[spec.job_id] = (req_id, offsets)
            into[req_id] += offsets
        for job_id in plan.flush:
            if job_id in self._job_offsets:
                req_id, offsets = self._job_offsets[job_id]
                rec.flushed[req_id] += offsets
        return rec

    def all(self, kind: str, req_id: str) -> set[Offset]:
        return {o for rec in self.records for o in getattr(rec, kind).get(req_id, [])}

    def blocks(self, kind: str, req_id: str) -> set[int]:
        """Like ``all`` with group 0's block indices only (single-group tests)."""
        return {i for g, i in self.all(kind, req_id) if g == 0}

    def forget_gpu_blocks(self, req_tokens: list[int], blocks: range | None = None) -> None:
        """Drop cached prefix blocks from the GPU prefix cache (as if evicted), keeping the CPU
        tier."""
        pool = self.engine.pool
        hashes = block_hashes(req_tokens, self.cfg.cache.block_size)
        for b in blocks if blocks is not None else range(len(hashes)):
            for g in range(len(self.cfg.cache.groups)):
                key = make_key(hashes[b], g)
                block = pool.lookup(key)
                if block is not None:
                    del pool._cached[key]
                    pool._key[block] = None

    def offload(self, req_id: str, prompt: list[int], gpu_blocks_kept: int = 0) -> Request:
        """Run ``prompt`` to the end as ``req_id``, then drop its blocks (all but the first
        ``gpu_blocks_kept``) from the GPU prefix cache: what it stored is left in the CPU tier
        only, for a later request to load."""
        req = self.add(req_id, prompt)
        self.run()
        n = len(block_hashes(prompt, self.cfg.cache.block_size))
        self.forget_gpu_blocks(prompt, range(gpu_blocks_kept, n))
        return req

    def drained(self) -> None:
        """DESIGN invariant 4: no jobs, empty fence, no request state, slots free or ready."""
        c = self.connector
        assert c is not None
        assert len(c.jobs) == 0, f"jobs left: {list(c.jobs.jobs)}"
        assert not c.fence, f"fence not empty: {c.fence.blocks()}"
        assert c.tracked() == 0, f"request states left: {[r.req_id for r in c._reqs]}"
        stats = c.directory.stats()
        assert stats.writing == 0 and stats.reading == 0
        for w in self.workers.workers:  # late reports: only of jobs a reset abandoned
            assert all(j < c.jobs.stale_below for j in w.held_jobs())


def tokens(n: int, start: int = 0) -> list[int]:
    """Distinct token ids (so distinct blocks hash differently)."""
    return list(range(start + 1, start + 1 + n))
