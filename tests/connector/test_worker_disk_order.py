"""The rank side's order with a disk tier (fakes record the calls: the interleaving they stand
for, a move a reset abandoned still writing a CPU slot while a new store is queued into it,
cannot be produced on demand with real threads)."""

from __future__ import annotations

from raykv.connector.worker import ConnectorWorker, FenceViolation
from raykv.core.step import BlockCopy, TransferPlan, TransferSpec, TransferStats


class Recorder:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls
        self.slots_in_use: set[int] = set()

    def submit(self, spec) -> None:
        self.calls.append(f"{self.name}.submit {spec.job_id}")

    def flush(self, job_ids) -> None:
        self.calls.append(f"{self.name}.flush {sorted(job_ids)}")
        self.slots_in_use = set()  # flushed: nothing of the abandoned move runs any more

    def drop(self, keys) -> None:
        self.calls.append(f"{self.name}.drop")

    def poll(self):
        return [], []

    def wait(self, timeout_s: float) -> None:
        pass

    def in_flight(self) -> int:
        return len(self.slots_in_use)

    def pending_slots(self):
        return set(), set(self.slots_in_use)

    def pending_reads(self) -> set[int]:
        return set()

    def pending_writes(self) -> set[int]:
        return set()

    def take_stats(self) -> TransferStats:
        return TransferStats()

    def take_corrupt(self) -> list[int]:
        return []

    def take_full(self) -> list[int]:
        return []


def test_abandoned_moves_are_flushed_before_a_store_is_queued_into_their_slot() -> None:
    """Found by review: a finished request's last store, flushed in the plan that makes it, was
    queued before the disk engine flushed a promotion a reset had abandoned, which was still
    writing the same CPU slot on this rank."""
    calls: list[str] = []
    cpu, disk = Recorder("cpu", calls), Recorder("disk", calls)
    disk.slots_in_use = {5}  # promotion 7, abandoned, still writes slot 5
    worker = ConnectorWorker(0, cpu, None, disk)
    store = TransferSpec(9, True, BlockCopy([3], [5], [0]))
    plan = TransferPlan(flush=[7, 9], stores=[store])
    worker.before_model(1, plan)
    assert calls.index("disk.flush [7, 9]") < calls.index("cpu.submit 9")


def test_a_store_into_a_slot_a_move_still_uses_is_a_fence_violation() -> None:
    calls: list[str] = []
    cpu, disk = Recorder("cpu", calls), Recorder("disk", calls)
    disk.slots_in_use = {5}
    worker = ConnectorWorker(0, cpu, None, disk)
    worker.before_model(1, TransferPlan())
    plan = TransferPlan(stores=[TransferSpec(9, True, BlockCopy([3], [5], [0]))])
    try:
        worker.after_model(plan, idle=False)
    except FenceViolation as exc:
        assert "CPU slots [5]" in str(exc)
    else:
        raise AssertionError("a store into a slot a move still uses was queued")
