"""One rank's step: the transfers before the model, the model, the transfers after, the report.

The connector's worker half only moves KV; the rank runner owns the order of a step and the
model. It is what each Ray rank actor runs, and what the in-process worker group runs for every
rank in turn.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from raykv.connector.worker import ConnectorWorker
from raykv.core.step import ModelEntry, ModelOutput, StepPlan, StepReport
from raykv.engine.rank_tables import RankTables


class ModelBackend(Protocol):
    """One rank's shard of the model: computes a step's batch, writing its KV into ``kv`` and
    answering, per entry, its part of the next token (0 for an entry that does not sample)."""

    def step(self, kv: Any, batch: list[ModelEntry]) -> ModelOutput: ...


class RankRunner:
    """Runs each step's plan on one rank."""

    def __init__(
        self, rank: int, transfers: ConnectorWorker, model: ModelBackend, kv: Any, block_size: int
    ) -> None:
        self.rank = rank
        self.transfers = transfers
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.tables = RankTables(rank)

    def execute(self, plan: StepPlan) -> StepReport:
        started = time.perf_counter()
        batch = self.tables.apply(plan)
        self.transfers.before_model(plan.step, plan.transfers)
        model_started = time.perf_counter()
        out = self._model_step(batch)
        model_s = time.perf_counter() - model_started
        report = self.transfers.after_model(plan.transfers, idle=not plan.batch)
        busy = time.perf_counter() - started
        return StepReport(self.rank, plan.step, report, out.samples, out.logprobs, busy, model_s)

    def _model_step(self, batch: list[ModelEntry]) -> ModelOutput:
        if not batch:
            return ModelOutput([])
        transfers = self.transfers
        bs = self.block_size
        transfers.check_writable([b for entry in batch for b in entry.written_blocks(bs)])
        transfers.check_readable(
            block for entry in batch if entry.samples for block in entry.read_blocks()
        )
        return self.model.step(self.kv, batch)
