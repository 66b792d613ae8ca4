"""What the engine scheduler hands the connector for a step (``ScheduledRequest``), and what
the connector hands back when a load ends (``FinishedLoad``)."""

from __future__ import annotations

from dataclasses import dataclass

from raykv.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """A request computing ``num_tokens`` tokens this step. ``loading``: its load from the CPU
    tier lands in this same step, before the model runs (``offload.load_in_step``), and the
    tokens come after the loaded ones; they count only if every rank acks that load in this
    step's reports."""

    req: Request
    num_tokens: int
    loading: bool = False

    @property
    def start(self) -> int:
        """Position of the first token computed this step."""
        req = self.req
        return req.num_computed + (req.load_tokens if self.loading else 0)


@dataclass(slots=True)
class FinishedLoad:
    req: Request
    ok: bool
