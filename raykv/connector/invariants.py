"""The connector's books checked against each other: DESIGN.md's scheduler-side invariants
(fence, acks, one load xor stores), for tests and fuzzers."""

from __future__ import annotations

from collections.abc import Mapping

from raykv.connector.fence import Fence
from raykv.connector.jobs import JobTable
from raykv.connector.lower_tiers import LowerTiers
from raykv.connector.state import RequestOffloadState
from raykv.core.request import Request


def check_connector(
    jobs: JobTable,
    fence: Fence,
    states: Mapping[Request, RequestOffloadState],
    lower: LowerTiers,
) -> None:
    """AssertionError where the connector's job table, fence and request states disagree."""
    fenced: dict[int, set[int]] = {}
    for job in jobs.jobs.values():
        assert 0 < job.pending_count <= jobs.num_ranks
        blocks = list(job.fenced_block_ids)
        if job.deferred_fenced:
            blocks += job.deferred_fence_block_ids
        for b in blocks:
            fenced.setdefault(b, set()).add(job.job_id)
        if job.request is None:
            assert job.move and lower, f"job {job.job_id} of no request"
            continue
        state = states.get(job.request)
        assert state is not None and job.job_id in state.jobs, f"orphan job {job.job_id}"
    assert fenced == {b: fence.jobs_on([b]) for b in fence.blocks()}
    assert set(fenced) == fence.blocks()
    for state in states.values():
        kinds = {jobs.jobs[j].is_store for j in state.jobs}
        assert not (state.has_load and len(state.jobs) != 1), "a load beside other jobs"
        assert state.has_load == (kinds == {False}), "load flag disagrees with jobs"
    lower.check_invariants()
