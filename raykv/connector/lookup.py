"""The lookup: how much of a waiting request the tiers can supply, over every KV group.

A full-attention group needs the whole prefix; a sliding-window group only the W chunks before
the boundary where computing resumes. The answer is the largest chunk boundary every group can
resume at ("convergence"), or "ask again next step" (None) while those chunks are still being
written or another request is loading them, bounded per request.

With tiers below the CPU tier (disk, shared store) the boundary is found twice: over the CPU
tier alone, and over every tier together (``connector/tier_view.py``). Where the second reaches
further, the chunks only a lower tier holds are promoted into the CPU tier (``DiskMoves.promote``,
``SharedMoves.promote``; from the nearest tier that holds each) and the request asks again until
they have landed; then it loads them like any CPU hit (one load per admission). What the shared
store holds is asked once per admission, for the chunks past what the local tiers hold
(``SharedMoves.discover``). A hit is promoted only as far as the CPU tier can hold it beside
what the load reads there: the longest prefix that fits, the rest computed.

Every wait is bounded by the clock, never by a count of steps (an idle engine's steps are
short, a busy one's long): a request stops waiting once it has waited ``max_wait_s`` in all, or,
where the choice priced its hit, once loading less (recomputing at worst) would have given its
first token sooner (``Decision.wait_s``). Then it takes what the CPU tier holds readable now,
or recomputes. Only its own load or stores in flight are waited for unbounded (DESIGN
invariant 3: they end by themselves).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from raykv.connector.shared_moves import SharedMoves
from raykv.connector.state import RequestOffloadState
from raykv.connector.stats import ConnectorStats
from raykv.connector.tier_moves import WAIT, DiskMoves
from raykv.connector.tier_view import UnionView
from raykv.connector.worth import Candidate, TierCosts
from raykv.core.kv_groups import KVGroup
from raykv.offload.directory import Directory

_DELAY_SAMPLES = 4096


class PrefixLookup:
    """Answers lookups against the directory and keeps the delay samples for the metrics."""

    def __init__(
        self,
        directory: Directory,
        groups: Sequence[KVGroup],
        block_size: int,
        blocks_per_chunk: int,
        max_wait_s: float,
        stats: ConnectorStats,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``max_wait_s``: the seconds a request may wait, in all, for what the tiers hold;
        ``clock``: what the waits are timed by (a test's own clock)."""
        self.directory = directory
        self.moves: DiskMoves | None = None  # the disk tier's moves, where there is one
        self.shared_moves: SharedMoves | None = None  # the shared tier's, where there is one
        # the measured costs that decide whether a hit is worth loading (None: every hit is)
        self.costs: TierCosts | None = None
        self.groups = list(groups)
        self.block_size = block_size
        self.bpc = blocks_per_chunk
        self.tpc = block_size * blocks_per_chunk
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.stats = stats
        # the latest lookup delays, for the metrics; bounded in case nobody reads them
        self.lookup_seconds: deque[float] = deque(maxlen=_DELAY_SAMPLES)
        self.deferred_seconds: deque[float] = deque(maxlen=_DELAY_SAMPLES)

    def lookup(
        self, state: RequestOffloadState, num_local: int, loading: Mapping[int, int]
    ) -> int | None:
        """Tokens after the ``num_local`` already on the GPU that the CPU tier can supply, or
        None to ask again next step. ``loading``: keys that loads in flight are reading."""
        start = self.clock()
        result = self._lookup(state, num_local, loading)
        if result is not None:
            state.choice = state.wait_limit_s = None  # answered: a later admission decides afresh
            state.store_asked = False
        now = self.clock()
        self.lookup_seconds.append(now - start)
        if result is None:
            if state.deferred_since is None:
                state.deferred_since = start
        elif state.deferred_since is not None:
            self.deferred_seconds.append(now - state.deferred_since)
            state.deferred_since = None
        if result is not None:
            self._end_wait(state)
        return result

    def _end_wait(self, state: RequestOffloadState) -> None:
        """A spell of waiting for the tiers ended: its seconds count towards the request's
        share."""
        if state.wait_since is not None:
            state.waited_s += self.clock() - state.wait_since
            state.wait_since = None

    def peek(self, state: RequestOffloadState, num_local: int) -> int:
        """About how many tokens after ``num_local`` the tier holds for this request: the prefix
        of its chunks present in every group, nothing counted, touched or deferred (to order
        the waiting queue; ``lookup`` decides what a load brings)."""
        if state.load_failed:
            return 0
        state.update_keys(self.block_size, self.bpc)
        tpc = self.tpc
        start = num_local // tpc
        end = (state.req.num_tokens - 1) // tpc
        lowers = self._lowers(state)
        view = UnionView(self.directory, *(d for _, d in lowers)) if lowers else None
        for gs in state.groups:
            present, _ = (view or self.directory).match_prefix(gs.keys[start:end], count=False)
            end = start + present
        return max(0, end * tpc - num_local)

    def _lowers(
        self, state: RequestOffloadState
    ) -> list[tuple[DiskMoves | SharedMoves, Directory]]:
        """The tiers below the CPU tier a lookup of ``state`` may reach, nearest first, with
        their moves (none once a promotion it waited for failed)."""
        if state.disk_failed or state.wait_over:
            return []
        out: list[tuple[DiskMoves | SharedMoves, Directory]] = []
        if self.moves is not None and self.moves.readable():
            out.append((self.moves, self.moves.disk))
        if self.shared_moves is not None and self.shared_moves.readable():
            out.append((self.shared_moves, self.shared_moves.shared))
        return out

    def take_delays(self) -> tuple[list[float], list[float]]:
        """Seconds spent in each lookup, and from a request's first deferred lookup to the one
        that answered it, since the last call (for the lookup-delay histograms)."""
        sync, deferred = list(self.lookup_seconds), list(self.deferred_seconds)
        self.lookup_seconds.clear()
        self.deferred_seconds.clear()
        return sync, deferred

    def _lookup(
        self, state: RequestOffloadState, num_local: int, loading: Mapping[int, int]
    ) -> int | None:
        self.stats.lookups += 1
        if state.jobs:
            # DESIGN invariant 3, whatever the deferral budget says: these jobs end by themselves
            # (acked, asked again after ack_timeout_steps, or failed with a rank declared dead);
            # a wait for them is not the tiers' and does not count against its share
            self._end_wait(state)
            self.stats.deferred_lookups += 1
            return None
        if state.load_failed:
            return 0  # a failed load falls back to recompute (DESIGN invariant 2)
        state.update_keys(self.block_size, self.bpc)
        tpc = self.tpc
        # at least the last token is computed, to produce the next one
        max_chunks = (state.req.num_tokens - 1) // tpc
        start = num_local // tpc
        if max_chunks <= start:
            return 0
        cpu = self.directory
        end, used, pending = self._converge(state, start, max_chunks, cpu)
        near = (end, used, pending)
        view: Directory | UnionView = cpu
        lowers = self._lowers(state) if end < max_chunks else []
        promote: list[list[int]] = [[] for _ in lowers]
        moves = self.moves
        if lowers:
            shared = self.shared_moves
            if shared is not None and not state.store_asked and any(m is shared for m, _ in lowers):
                state.store_asked = True  # once per admission: the store is another process
                # a chunk on disk does not end the prefix the store is asked about
                disk = moves.disk if moves is not None and moves.readable() else ()
                for gs in state.groups:
                    shared.discover(gs.keys[end:max_chunks], disk)
            union = UnionView(cpu, *(d for _, d in lowers))
            far = self._converge(state, start, max_chunks, union)
            if far[0] > end:
                far = self._within_room(state, start, far, union)
            if far[0] > end:
                end, used, pending = far
                view = union
                promote = union.sources(used)
        # refresh what resuming at ``end`` needs: a full-attention group's whole prefix, a
        # sliding-window group's last window only (older chunks of it are never read again)
        touched: list[int] = []
        for group, gs in zip(self.groups, state.groups, strict=True):
            lo = max(0, end - group.window_chunks(tpc)) if group.is_sliding else 0
            touched.extend(gs.keys[lo:end])
        view.touch(touched)
        if moves is not None:  # asked for: what the disk tier's own filter admits by
            moves.disk.note_asked(k for k in touched if k in cpu)
        if self.costs is not None and end > start:
            by_tier = {
                self._tier_name(m): len(k) for (m, _), k in zip(lowers, promote, strict=True)
            }
            taken = self._choose(state, num_local, (near[0], near[1]), (end, used, by_tier))
            if taken < end:  # recomputing, or loading less, comes sooner
                if taken == near[0]:
                    end, used, pending = near
                    promote = [[] for _ in lowers]
                elif taken <= start:
                    end, used, pending = start, [], False
                    promote = [[] for _ in lowers]
                else:  # a boundary decided when it first asked, where the room cut it then
                    end, used, pending = self._converge(state, start, taken, view, count=False)
                    promote = (
                        view.sources(used) if isinstance(view, UnionView) else [[] for _ in lowers]
                    )
        if end <= start:
            return 0
        near_end, near_used, _ = near

        def fallback() -> int:
            # what it takes once its wait is over: what the CPU tier holds readable now
            ready = self._ready_prefix(state, start, min(near_end, end), loading)
            return max(0, ready * tpc - num_local) if ready > start else 0

        if pending or any(k in loading for k in used):
            return self._defer(state, fallback)
        if any(promote):
            started = waiting = refused = False
            for (mover, _), keys in zip(lowers, promote, strict=True):
                if not keys:
                    continue
                # what it loads beside them is never evicted to make their room
                job = mover.promote(keys, state, keep=[*used, *near_used])
                if job == WAIT:
                    waiting = True
                elif job is None:
                    refused = True
                else:
                    started = True
                    (state.fetched if mover is self.shared_moves else state.promoted).update(keys)
            if not refused and (started or waiting):
                if started and not waiting:  # ask again once they have landed
                    self.stats.promotions_waited += 1
                return self._defer(state, fallback)  # or once the next plans made room
            # never room in the CPU tier for them: what it alone holds
            end, used, pending = near
            if end <= start:
                return 0
            if pending or any(k in loading for k in used):
                return self._defer(state, fallback)
        return max(0, end * tpc - num_local)

    def _ready_prefix(
        self, state: RequestOffloadState, start: int, limit: int, loading: Mapping[int, int]
    ) -> int:
        """The furthest boundary up to ``limit`` the CPU tier can load from now: every chunk
        it reads ready there, none being loaded by another request (the start: none)."""
        found = self._furthest(
            state,
            start,
            limit + 1,
            self.directory,
            lambda used, pending: not pending and not any(k in loading for k in used),
        )
        return found[0]

    def _furthest(
        self,
        state: RequestOffloadState,
        start: int,
        beyond: int,
        view: Directory | UnionView,
        ok: Callable[[list[int], bool], bool],
    ) -> tuple[int, list[int], bool]:
        """The furthest boundary before ``beyond`` (as ``_converge`` finds it in ``view``) whose
        keys and pending flag ``ok`` takes; the start (nothing) where none is. A bisection: a
        boundary that ``ok`` takes is taken by those before it."""
        best: tuple[int, list[int], bool] = (start, [], False)
        lo, hi = start, beyond
        while hi - lo > 1:
            mid = (lo + hi) // 2
            found = self._converge(state, start, mid, view, count=False)
            if ok(found[1], found[2]):
                lo, best = mid, found
            else:
                hi = mid
        return best

    def _within_room(
        self,
        state: RequestOffloadState,
        start: int,
        far: tuple[int, list[int], bool],
        union: UnionView,
    ) -> tuple[int, list[int], bool]:
        """``far`` (a boundary over every tier, the keys its load reads, whether any is being
        written), or the furthest boundary before it whose chunks the CPU tier can hold at once
        (those promoted into it beside those the load reads there): a hit larger than the CPU
        tier loads what fits and computes the rest."""
        room = self.directory.capacity - self.directory.num_held
        if len(set(far[1])) <= room:
            return far
        return self._furthest(state, start, far[0], union, lambda used, _: len(set(used)) <= room)

    def _tier_name(self, mover: DiskMoves | SharedMoves) -> str:
        return "shared" if mover is self.shared_moves else "disk"

    def _choose(
        self,
        state: RequestOffloadState,
        num_local: int,
        near: tuple[int, list[int]],
        far: tuple[int, list[int], dict[str, int]],
    ) -> int:
        """The chunk boundary worth loading to (``connector/worth.py``): ``near``'s end (the CPU
        tier's hit, and the keys it loads), ``far``'s (with the chunks only a tier below holds,
        counted by tier), or none (the request's own start); the prediction goes on the
        request."""
        assert self.costs is not None
        tpc, bpc = self.tpc, self.bpc
        near_end, near_used = near
        end, used, below = far
        start = num_local // tpc
        if state.choice is not None:  # decided when it first asked: kept while it waits
            return state.choice // tpc if state.choice > num_local else start
        options: list[Candidate] = []
        if near_end > start:
            options.append(Candidate(near_end * tpc, cpu_blocks=len(near_used) * bpc))
        if end > near_end:
            disk, shared = below.get("disk", 0) * bpc, below.get("shared", 0) * bpc
            options.append(Candidate(end * tpc, len(used) * bpc - disk - shared, disk, shared))
        req = state.req
        decision = self.costs.choose(num_local, req.num_tokens, options)
        req.predicted_s, req.predicted_recompute_s = decision.predicted_s, decision.recompute_s
        state.choice, state.wait_limit_s = decision.end, decision.wait_s
        return decision.end // tpc if decision.end > num_local else start

    def _defer(self, state: RequestOffloadState, fallback: Callable[[], int]) -> int | None:
        """Ask again next step (None), unless this request has waited its share, in all: then
        ``fallback()`` tokens (what it takes without waiting; vLLM #49829: a write that never
        finishes must not park a request for ever). Its share is ``max_wait_s``, and no more
        than its hit is worth where the choice priced it (``state.wait_limit_s``)."""
        now = self.clock()
        if state.wait_since is None:
            state.wait_since = now
        waited = state.waited_s + now - state.wait_since
        limit = self.max_wait_s
        if state.wait_limit_s is not None:
            limit = min(limit, state.wait_limit_s)
        if state.wait_over or waited >= limit:
            if not state.wait_over:
                state.wait_over = True
                self.stats.deferral_timeouts += 1
            return fallback()
        self.stats.deferred_lookups += 1
        return None

    def _converge(
        self,
        state: RequestOffloadState,
        start: int,
        max_chunks: int,
        d: Directory | UnionView,
        count: bool = True,
    ) -> tuple[int, list[int], bool]:
        """The largest chunk boundary every group can resume at in ``d`` (a tier, or the tiers
        together), the keys a load would read, and whether any of them is still being written.
        ``count``: the keys examined count as looked up (once per lookup: not on a second
        pass)."""
        end = max_chunks
        for g, group in enumerate(self.groups):
            if group.is_sliding:
                continue
            keys = state.groups[g].keys
            present, _ = d.match_prefix(keys[start:end], count=count)
            end = start + present
            if end <= start:
                return start, [], False
        # a sliding-window group needs only the W chunks before the boundary; a boundary that
        # fails it is moved left until every sliding group is satisfied (full groups still are).
        # Every key checked counts as looked up, once (the frequency filter counts lookups).
        examined: dict[int, None] = {}
        while end > start:
            ok = True
            for g, group in enumerate(self.groups):
                if not group.is_sliding:
                    continue
                w = group.window_chunks(self.tpc)
                keys = state.groups[g].keys
                for key in keys[max(start, end - w, 0) : end]:
                    examined[key] = None
                    if key not in d:
                        ok = False
                        break
                if not ok:
                    break
            if ok:
                break
            end -= 1
        if count:
            d.count_lookups(examined)
        if end <= start:
            return start, [], False
        used: list[int] = []
        for g, group in enumerate(self.groups):
            keys = state.groups[g].keys
            lo = max(start, end - group.window_chunks(self.tpc)) if group.is_sliding else start
            used.extend(keys[lo:end])
        return end, used, any(not d.is_readable(k) for k in used)
