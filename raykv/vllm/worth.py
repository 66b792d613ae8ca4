"""``take_hits: faster`` inside vLLM: a hit in raykv's tiers is loaded only where the request's
first token comes sooner than by computing the same tokens, priced by raykv's own cost model
(``connector/worth.py``) from what vLLM lets the manager see.

vLLM hides the model's time from a spec: the manager sees neither a step's tokens nor its
forward. What it sees: when vLLM has scheduled a step it calls ``on_schedule_end``, then offers
for storing (``prepare_store``) the chunks that step's forward fills; the next step's
``on_schedule_end`` comes once that forward is done. So a step's prefill is measured as the
tokens of the chunks offered after one schedule end (each request's from where it computes:
the end of its load, or of its last offer) against the seconds to the next (the forward, the
copies raykv's workers run after it, and the next scheduling: what a request computing in that
step waits for). Partial chunks and decodes are not offered, so their tokens count as the
step's overhead. A load is measured from ``prepare_load`` to ``complete_load``: vLLM schedules
the request in the step after that, so that is what the load delayed it; a load that promoted
chunks from the disk or the store measures that tier with the CPU part taken off. Before a tier
has its samples (``MIN_SAMPLES``, fewer than raykv's engine wants: a slow tier costs every
request it serves meanwhile) it is priced by the prior of raykv's engine (a load waits a step:
the median of the busy steps).

A request served wholly from the tiers offers no chunk for storing, so traffic where every
request hits would never price the recompute (found: a warm restart from a disk at 800 ms a
load took it for all 12 requests, 10.8x vLLM alone's time to first token). So until the prefill
has its samples, every other request that would load recomputes instead (``recompute_probes``):
its chunks are offered, and timed; from then on the choice is priced.

The lookup looks ahead: at the first key of a request's lookup, the keys after it (vLLM hands
the request's chunk boundaries in the lookup's context; those of the key's KV group and whole
chunks only) are found in the tiers (the store asked for those no tier of this engine holds),
the choice is made for the whole prefix, and each key beyond the chosen end answers MISS, one
being written there too. The decision stands while the request waits in vLLM's queue (looked
up again each step), so its skipped hits count once. vLLM looks a sliding-window group up from
its end: past that first key the choice steps aside.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from raykv.connector.worth import Candidate, TierCosts

T = TypeVar("T")
REMEMBERED = 4096  # requests whose lookup or load is remembered (bounded memory)
MIN_SAMPLES = 2  # observations the prefill's and each tier's fit need to price anything
RECOMPUTE_PROBE_EVERY = 2  # while the prefill is not priced: one request in this recomputes
IDLE_GAP = 10.0  # a step this many times the usual one followed an idle engine


@dataclass(slots=True)
class _Round:
    """A request's decision: the position of the first key it was made at, and the position
    beyond which keys miss (None: every hit is taken)."""

    first: int
    end: int | None


class LoadChoice:
    """The manager's choice between a load and a recompute, and what it measured.
    ``chunk_tokens``: tokens per offloaded chunk; ``blocks_per_chunk``: vLLM blocks per chunk."""

    def __init__(self, chunk_tokens: int, blocks_per_chunk: int) -> None:
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = blocks_per_chunk
        # one step per prompt: a request's measured recompute is its steps' whole time
        self.costs = TierCosts(step_tokens=1 << 40, min_samples=MIN_SAMPLES)
        self._unpriced = 0  # decisions with a hit made while the prefill was not priced
        self.recompute_probes = 0  # of them, those recomputed to measure the prefill
        self._rounds: OrderedDict[str, _Round] = OrderedDict()
        self._computed: OrderedDict[str, int] = OrderedDict()  # where each request computes from
        self._loading: OrderedDict[str, tuple[float, int, int, int]] = OrderedDict()
        # tokens offered for storing since the last schedule end (the step vLLM just scheduled
        # computes them), and their attention work
        self._tally = (0, 0.0)
        self._last_schedule_end: float | None = None
        self._warm = False  # a step with a prefill timed (the first is not kept)

    # ---- the choice --------------------------------------------------------------------------

    def limit(
        self,
        req_id: str,
        position: int,
        boundaries: Callable[[], list[tuple[int, T]]],
        tier_of: Callable[[T], str | None],
    ) -> int | None:
        """The position beyond which this request's keys miss (None: none do). ``position``:
        where the chunk being looked up ends. Where the request has no decision yet, or its
        lookup starts elsewhere than the decision's: ``boundaries`` gives every chunk of the
        request (its end, its key) in order, and ``tier_of`` the tier that holds a key ready
        (None: none does), asked for the chunks from this one on up to the first that no tier
        holds. A request waiting in vLLM's queue is looked up every step: its decision stands
        (and its skipped hits count once) until its lookup starts elsewhere."""
        ongoing = self._rounds.get(req_id)
        if ongoing is not None:
            # a lookup from the end (a sliding window's) is not a prefix this prices
            return None if position < ongoing.first else ongoing.end
        start = position - self.chunk_tokens
        chunks = boundaries()
        ahead = [(end, key) for end, key in chunks if end >= position]
        prompt = chunks[-1][0] if chunks else position
        options: list[Candidate] = []
        blocks = {"cpu": 0, "disk": 0, "shared": 0}
        for end, key in ahead:
            tier = tier_of(key)
            if tier is None:
                break
            blocks[tier] += self.blocks_per_chunk
            options.append(Candidate(end, blocks["cpu"], blocks["disk"], blocks["shared"]))
        decision = self.costs.choose(start, prompt, options)
        decided = decision.end
        if options and not self.costs.priced():
            self._unpriced += 1
            if self._unpriced % RECOMPUTE_PROBE_EVERY == 0:  # computed, to price the next ones
                self.recompute_probes += 1
                decided = start
        end = None if options and decided >= options[-1].end else decided
        self._remember(self._rounds, req_id, _Round(position, end))
        self._remember(self._computed, req_id, max(start, decided))
        return end

    def deciding(self, req_id: str) -> bool:
        """Whether the request has a decision (a key being written past its end misses too)."""
        return req_id in self._rounds

    @property
    def skipped(self) -> dict[str, int]:
        """Hits passed over as slower than recomputing, by the deepest tier they loaded from."""
        return dict(self.costs.skipped_slower)

    # ---- what vLLM shows of the costs --------------------------------------------------------

    def stored(self, req_id: str, position: int, chunks: int = 1) -> None:
        """``chunks`` chunks of the request, up to ``position``, are offered for storing: the
        step just scheduled computes them (from the end of its load or last offer, where
        known)."""
        since = self._computed.get(req_id, position - chunks * self.chunk_tokens)
        if position <= since:
            return
        tokens = position - since
        total, attention = self._tally
        self._tally = (total + tokens, attention + tokens * (since + position - 1) / 2)
        self._remember(self._computed, req_id, position)

    def cut(self, req_id: str, position: int) -> None:
        """The request's hit ends at ``position`` at the latest, whatever was priced (the CPU
        tier had no room to promote the rest): it computes from there."""
        if position < self._computed.get(req_id, position):
            self._computed[req_id] = position

    def loading(
        self,
        req_id: str,
        cpu_chunks: int,
        disk_chunks: int,
        shared_chunks: int,
        end: int | None = None,
    ) -> None:
        """A load of the request starts (chunks from each tier; ``end``: the position its
        last chunk ends at, from which the request computes)."""
        self._rounds.pop(req_id, None)  # a lookup after it (a preemption's) decides anew
        if end is not None:
            self._remember(self._computed, req_id, end)
        bpc = self.blocks_per_chunk
        since = time.perf_counter()
        chunks = (since, cpu_chunks * bpc, disk_chunks * bpc, shared_chunks * bpc)
        self._remember(self._loading, req_id, chunks)

    def loaded(self, req_id: str, ok: bool) -> None:
        """The request's load ended; a good one measures its tiers."""
        started = self._loading.pop(req_id, None)
        # a forward has run by the time a load's request computes (what an engine's first
        # forward initializes is paid): the next step that offers chunks is timed
        self._warm = True
        if started is None or not ok:
            return
        since, cpu, disk, shared = started
        seconds = time.perf_counter() - since
        blocks = cpu + disk + shared
        if not disk and not shared:
            self.costs.observe_load(blocks, seconds)
            return
        # the promotion's share: what the copy out of the CPU tier would not have taken
        rest = max(0.0, seconds - self.costs.move_s("cpu", blocks))
        if disk:
            self.costs.observe_promotion(disk, rest)
        if shared:
            self.costs.shared.add(shared, rest)

    def schedule_ended(self) -> None:
        """vLLM ends a step's scheduling before it offers that step's chunks for storing: the
        chunks offered since the last schedule end are the step before's, whose forward is
        done now, and it took the time since."""
        now = time.perf_counter()
        costs = self.costs
        tokens, attention = self._tally
        if tokens > 0 and self._last_schedule_end is not None:
            seconds = now - self._last_schedule_end
            # an idle engine schedules nothing: a gap far past the usual step is no step; and
            # an engine's first forward initializes lazily (measured: 2.1 s for a step of
            # 10 ms), which would price every recompute for a window of steps
            usual = costs.step_period_s
            if not self._warm:
                self._warm = True
            elif not usual or seconds < IDLE_GAP * usual:
                costs.prefill.add(tokens, attention, seconds)
                costs.observe_duration(seconds)
        self._tally = (0, 0.0)
        self._last_schedule_end = now

    def finished(self, req_id: str) -> None:
        for table in (self._rounds, self._computed, self._loading):
            table.pop(req_id, None)

    @staticmethod
    def _remember(table: OrderedDict, req_id: str, value: object) -> None:
        table[req_id] = value
        table.move_to_end(req_id)
        while len(table) > REMEMBERED:
            table.popitem(last=False)
