"""A rank's copy of the running requests' block tables, kept between steps.

The scheduler sends each request's table whole once (under a fresh key), then only the entries
that change: a decode step adds at most one block per group, so the step message stays the size
of the batch, not of the batch's contexts (a 32k-token request has 2,048 entries per group).
Each rank applies a plan's changes before its model step and hands the model whole tables.

The protocol checks itself: a change that does not follow on from what the rank holds (an
unknown key past its first entry, a known key sent whole again, a gap) raises
:class:`TableMismatch` instead of letting the model read blocks the scheduler never meant.
"""

from __future__ import annotations

import msgspec

from raykv.core.step import ModelEntry, StepPlan


class TableMismatch(RuntimeError):
    """A plan's table change does not follow on from what this rank holds (a protocol bug)."""


class RankTables:
    """The block tables one rank holds, by ``ModelEntry.table_key``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.epoch = -1  # no plan seen yet: the first one starts its epoch
        self.tables: dict[int, list[list[int]]] = {}

    def apply(self, plan: StepPlan) -> list[ModelEntry]:
        """Apply the plan's changes; its batch with every entry's whole tables (copies of the
        entries: the plan itself is left as it came, as the ranks of one process share it)."""
        tables = self.tables
        if plan.tables_epoch != self.epoch:
            tables.clear()
            self.epoch = plan.tables_epoch
        for key in plan.forget:
            tables.pop(key, None)  # a rank that joined after the key was sent never had it
        batch = []
        # one loop, no call per entry: this runs on every rank for every request every step
        for entry in plan.batch:
            key, start, changes = entry.table_key, entry.table_from, entry.block_tables
            held = tables.get(key)
            if held is None and start == 0:
                held = tables[key] = [list(group) for group in changes]
            elif held is not None and start > 0 and len(held) == len(changes):
                for table, group in zip(held, changes):  # noqa: B905 (lengths checked above)
                    if len(table) < start:
                        raise TableMismatch(
                            f"rank {self.rank}: table {key} holds {len(table)} entries, "
                            f"changes start at {start}"
                        )
                    table[start:] = group
            else:
                raise self._mismatch(key, start, held, len(changes))
            batch.append(msgspec.structs.replace(entry, block_tables=held))
        return batch

    def _mismatch(
        self, key: int, start: int, held: list[list[int]] | None, groups: int
    ) -> TableMismatch:
        if start == 0:
            return TableMismatch(f"rank {self.rank}: table {key} sent whole twice")
        if held is None:
            return TableMismatch(
                f"rank {self.rank}: changes from entry {start} of table {key}, "
                "which this rank does not hold"
            )
        return TableMismatch(
            f"rank {self.rank}: table {key} has {len(held)} groups, its changes {groups}"
        )

    def __len__(self) -> int:
        return len(self.tables)
