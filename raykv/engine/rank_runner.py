"""One rank's step: the transfers before the model, the model, the transfers after, the report.

The connector's worker half only moves KV; the rank runner owns the order of a step and the
model. It is what each Ray rank actor runs, and what the in-process worker group runs for every
rank in turn.
"""

from __future__ import annotations

from typing import Any, Protocol

from raykv.connector.worker import ConnectorWorker
from raykv.core.step import ModelEntry, StepPlan, StepReport, WriteSpan


class ModelBackend(Protocol):
    """One rank's shard of the model: writes the KV of a span of tokens, and digests the KV a
    sampling request reads (its part of the next token)."""

    def write(self, kv: Any, span: WriteSpan) -> None: ...
    def checksum(self, kv: Any, blocks: list[int]) -> int: ...


class RankRunner:
    """Runs each step's plan on one rank."""

    def __init__(self, rank: int, transfers: ConnectorWorker, model: ModelBackend, kv: Any) -> None:
        self.rank = rank
        self.transfers = transfers
        self.model = model
        self.kv = kv

    def execute(self, plan: StepPlan) -> StepReport:
        self.transfers.before_model(plan.step, plan.transfers)
        samples = self._model_step(plan.batch)
        report = self.transfers.after_model(plan.transfers, idle=not plan.batch)
        return StepReport(self.rank, plan.step, report, samples)

    def _model_step(self, batch: list[ModelEntry]) -> list[int]:
        if not batch:
            return []
        kv, model, transfers = self.kv, self.model, self.transfers
        transfers.check_writable([b for entry in batch for s in entry.writes for b in s.blocks])
        for entry in batch:
            for span in entry.writes:
                model.write(kv, span)
        samples = []
        for entry in batch:
            transfers.check_readable(entry.read_blocks)
            samples.append(model.checksum(kv, entry.read_blocks) if entry.read_blocks else 0)
        return samples
