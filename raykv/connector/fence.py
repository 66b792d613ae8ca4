"""The fence: GPU blocks that unfinished stores still read.

Strict by design: registering a block twice for one job, or releasing what was never registered,
raises. Tolerating either would hide the bug that caused it (a block listed twice in one job means
a stale block id slipped into a store, which is silent corruption).
"""

from __future__ import annotations

from collections.abc import Iterable


class FenceError(RuntimeError):
    """The fence's books do not balance: a protocol bug, never a normal condition."""


class Fence:
    """Block id -> ids of the unfinished store jobs that read it."""

    def __init__(self) -> None:
        self._jobs: dict[int, set[int]] = {}

    def add(self, job_id: int, blocks: Iterable[int]) -> None:
        for block in blocks:
            jobs = self._jobs.setdefault(block, set())
            if job_id in jobs:
                raise FenceError(f"job {job_id} registers GPU block {block} twice")
            jobs.add(job_id)

    def remove(self, job_id: int, blocks: Iterable[int]) -> None:
        for block in blocks:
            jobs = self._jobs.get(block)
            if jobs is None or job_id not in jobs:
                raise FenceError(f"job {job_id} releases GPU block {block} it never registered")
            jobs.discard(job_id)
            if not jobs:
                del self._jobs[block]

    def jobs_on(self, blocks: Iterable[int]) -> set[int]:
        """Jobs that must finish before any of these blocks is written."""
        out: set[int] = set()
        table = self._jobs
        for block in blocks:
            jobs = table.get(block)
            if jobs:
                out |= jobs
        return out

    def blocks(self) -> set[int]:
        return set(self._jobs)

    def clear(self) -> None:
        self._jobs.clear()

    def __len__(self) -> int:
        return len(self._jobs)

    def __bool__(self) -> bool:
        return bool(self._jobs)
