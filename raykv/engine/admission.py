"""Which waiting request goes first, and when a step leaves its decodes for the next one.

Two choices the scheduler makes around its queues, each a policy with a measured reason:
``engine.schedule_policy`` orders the head of the waiting queue (shortest remaining prefill
first, bounded against starvation), and ``engine.short_prefill_alone`` lets a short first-token
step run without the decode batch. Neither touches blocks or the connector; the scheduler hands
in what a request still has to compute.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import get_args

from raykv.config import SchedulePolicy
from raykv.connector.scheduled import ScheduledRequest
from raykv.core.request import Request

SCHEDULE_POLICIES: tuple[str, ...] = get_args(SchedulePolicy)
REORDER_WINDOW = 64  # waiting requests the shortest-prefill policy orders each step


class AdmissionOrder:
    """The admission order of ``engine.schedule_policy`` and the decode hold-back of
    ``engine.short_prefill_alone``.

    ``policy``: ``fcfs`` admits in arrival order. ``shortest-prefill``: among the first
    ``REORDER_WINDOW`` waiting, the one with the fewest prompt tokens left to compute once the
    GPU prefix cache and the tiers have supplied theirs goes first (ties by arrival), so a
    request served from a cache is not held behind a long prompt computed from scratch (shortest
    remaining work first: the order that minimises mean time to first token); a request that has
    waited ``max_bypass_steps`` steps goes before all of those, in arrival order, so none
    starves. ``prefill_left``: about how many prompt tokens a request computes once the caches
    have supplied theirs (no side effects).

    ``short_prefill_alone``: a step whose prompt work finishes a prompt and computes at most
    this many tokens in all (a prompt the caches served, its last block computed beside its
    load) leaves the running decodes to the next step, so that first token comes from a short
    step instead of one carrying the decode batch; never two steps in a row, so a decode waits
    at most one short step, and never while requests are left waiting, whom the decodes'
    blocks and seats, held a step longer, would delay too (0: never).
    """

    def __init__(
        self,
        policy: str,
        max_bypass_steps: int,
        short_prefill_alone: int,
        prefill_left: Callable[[Request], int],
    ) -> None:
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}; one of {SCHEDULE_POLICIES}")
        self.policy = policy
        self.max_bypass_steps = max_bypass_steps
        self.short_prefill_alone = short_prefill_alone
        self._prefill_left = prefill_left
        self._decodes_waited = False  # the last step left the decodes out

    def reorder(self, waiting: deque[Request], step: int) -> None:
        """Reorder the head of ``waiting`` in place as the policy says."""
        if self.policy == "fcfs" or len(waiting) < 2:
            return
        head = [waiting.popleft() for _ in range(min(REORDER_WINDOW, len(waiting)))]

        def key(req: Request) -> tuple[int, int, int]:
            if self.starved(req, step):
                return (0, 0, req.index)
            return (1, self._prefill_left(req), req.index)

        head.sort(key=key)
        waiting.extendleft(reversed(head))

    def starved(self, req: Request, step: int) -> bool:
        """``req`` has been passed over long enough to go first."""
        return step - req.queued_step >= self.max_bypass_steps

    def hold_decodes(
        self, scheduled: list[ScheduledRequest], requests_waiting: bool
    ) -> list[ScheduledRequest] | None:
        """The step's entries without its decodes when this step should run its short prompt
        work alone, else None (and the decodes run). A decode left out keeps the block it may
        have been given for its next position and is scheduled again next step."""
        held = self._hold(scheduled, requests_waiting)
        self._decodes_waited = held is not None
        return held

    def _hold(
        self, scheduled: list[ScheduledRequest], requests_waiting: bool
    ) -> list[ScheduledRequest] | None:
        if self.short_prefill_alone <= 0 or self._decodes_waited or requests_waiting:
            # with requests left waiting, a decode held back holds its blocks and seat a step
            # longer, and each of them waits that step too: not worth one first token
            return None
        decodes = [s for s in scheduled if not s.loading and s.start >= s.req.num_prompt]
        prompts = [s for s in scheduled if s.loading or s.start < s.req.num_prompt]
        if not decodes or not any(s.start + s.num_tokens == s.req.num_tokens for s in prompts):
            return None
        if sum(s.num_tokens for s in prompts) > self.short_prefill_alone:
            return None
        return prompts
