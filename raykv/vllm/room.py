"""The CPU room a hit's load needs inside vLLM.

A chunk on disk or in the store is loaded through a CPU slot (promoted, then copied into vLLM's
KV cache), and a CPU hit the load keeps is a slot nobody may evict meanwhile. A load refused
for want of room fails, and vLLM looks the request up again: a hit that could never fit came
back for ever. So a lookup offers no more promotions than the CPU tier's usable slots beside
the request's kept hits (the rest of the prompt is computed), and a hit that fits the tier but
not its room now is asked again at a later step (vLLM's ``RETRY``) while loads and stores free
their slots, for a bounded time. Only one KV group is served (``worker.py`` refuses more), so
one budget per request is the whole load's. The budget counts hits in the order looked up, as
vLLM's prefix scan makes them; a sliding window's scan (from the end, going on past a miss)
counts hits it then drops, so there the room is underused, never overrun.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import LookupResult

from raykv.offload.directory import Directory

# how long a request's hit waits for CPU room (slots being written or read free within a load
# or a store) before the part that does not fit is computed
ROOM_WAIT_S = 2.0
MAX_REFUSED = 4096  # requests remembered as refused a load (the oldest forgotten first)


@dataclass(slots=True)
class _Offer:
    """What one step's lookups offered one request."""

    room: int  # the CPU tier's room at the request's first lookup in the step
    kept: set[int] = field(default_factory=set)  # CPU hits its load keeps
    promoted: set[int] = field(default_factory=set)  # hits below, each into a CPU slot
    idle_kept: int = 0  # of the kept, those the room counted (nobody else reads them)
    waiting: bool = False  # a hit was asked again later (RETRY), its wait not run out


class PromotionRoom:
    """Which of a request's hits its load can take, given the CPU tier's slots.

    Args:
        cpu: the CPU tier's directory.
        wait_s: how long a request waits for room before it computes what does not fit.
        clock: seconds, monotonic (a test's clock).
    """

    def __init__(
        self,
        cpu: Directory,
        wait_s: float = ROOM_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cpu = cpu
        self.wait_s = wait_s
        self.clock = clock
        self._offers: dict[str, _Offer] = {}  # this step's, by request
        # requests waiting for room, since when: the wait counts from the first of the steps
        # in a row that asked them again, so a request that waited once waits again later
        self._waiting: dict[str, float] = {}
        # requests whose load was refused all the same: their next lookups offer nothing below
        # the CPU tier, so each makes progress whatever the room did (insertion-ordered)
        self._refused: dict[str, None] = {}

    def offer(self, key: int, request: str) -> LookupResult:
        """A hit on ``key`` (in some tier) as the request's load can take it: HIT, RETRY
        (ask again later: the room is busy now) or MISS (the rest is computed)."""
        cpu = self.cpu
        offer = self._offers.get(request)
        if offer is None:
            offer = self._offers[request] = _Offer(room=cpu.room())
        if key in offer.kept or key in offer.promoted:  # looked up again in this step
            return LookupResult.HIT
        in_cpu = cpu.is_readable(key)
        idle = in_cpu and cpu.is_idle(key)  # keeping it takes a slot the room counted
        if in_cpu and not offer.promoted:  # no promotion needs its slot
            self._keep(offer, key, idle)
            return LookupResult.HIT
        if not in_cpu and request in self._refused:
            return LookupResult.MISS
        # the load's promotions, and the slots it keeps, with this hit
        promotions = len(offer.promoted) + (0 if in_cpu else 1)
        kept = len(offer.kept) + (1 if in_cpu else 0)
        if promotions + kept > cpu.capacity - cpu.num_held:
            return LookupResult.MISS  # never fits: slots held for minutes count as gone
        if promotions > offer.room - offer.idle_kept - idle:
            since = self._waiting.setdefault(request, self.clock())
            offer.waiting = self.clock() - since < self.wait_s
            return LookupResult.RETRY if offer.waiting else LookupResult.MISS
        if in_cpu:
            self._keep(offer, key, idle)
        else:
            offer.promoted.add(key)
        return LookupResult.HIT

    @staticmethod
    def _keep(offer: _Offer, key: int, idle: bool) -> None:
        offer.kept.add(key)
        offer.idle_kept += idle

    def loading(self, request: str, refused: bool) -> None:
        """The request's load was prepared (or refused for want of room after all)."""
        self.finished(request)
        if refused:
            self._refused[request] = None
            if len(self._refused) > MAX_REFUSED:  # the oldest go: their requests are long done
                for old in list(self._refused)[: len(self._refused) - MAX_REFUSED]:
                    del self._refused[old]

    def finished(self, request: str) -> None:
        """The request's wait and refusal are forgotten."""
        self._waiting.pop(request, None)
        self._refused.pop(request, None)

    def step_ended(self) -> None:
        """The next step's lookups see the room as it is then; a request looked up in this
        step and not asked again (or whose wait ran out) waits afresh next time."""
        for request, offer in self._offers.items():
            if not offer.waiting:
                self._waiting.pop(request, None)
        self._offers.clear()
