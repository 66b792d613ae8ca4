"""The per-step fan-out on a Ray Compiled Graph (``parallel.control_plane: graph``).

One graph, compiled once for the ranks now serving: its input is a step's encoded plan, its
outputs the ranks' encoded reports (``cluster/wire.py``). Executing it writes the plan once into
a shared-memory channel every rank actor reads, and each rank writes its report into a channel
of its own: no task submission, no object store, no scheduling per step. Measured on 2 cores, a
step's round trip costs a fraction of one plain actor call per rank (``raykv bench step --engine
ray``).

Failures keep the plain path's meaning. A rank that dies ends the graph (Ray tears it down and
raises); a rank that does not answer within ``parallel.step_timeout_s`` times the get out.
Either way every rank is asked, by a plain call, for its reply to that step: a rank that has it
is alive and its reply counts (its acks are not lost), a dead one raises, and one that still has
nothing is silent, treated as dead. Those go to the engine in ``RankFailed`` as before;
``restart`` kills them, then the graph is torn down (the survivors leave it, and may join the
next), they are replaced and the graph is compiled again for the new set of ranks. Every wait is
bounded.
"""

from __future__ import annotations

import contextlib
import logging
import time
from functools import partial
from typing import Any, NoReturn

import ray

from raykv.cluster import wire
from raykv.cluster.worker_group import RayWorkerGroup
from raykv.core.step import StepPlan, StepReport
from raykv.engine.ranks import RankFailed, SentStep, StepHandle

log = logging.getLogger(__name__)
# Ray narrates every teardown at INFO (four lines per run, more per restart): keep its warnings
logging.getLogger("ray.dag.compiled_dag_node").setLevel(logging.WARNING)

# The failure path asks each rank for its reply by plain call; an actor that does not answer the
# question itself within this long is silent (its process is stuck, not just its step).
REPLY_ASK_S = 10.0

# what a rank's death or silence looks like from the graph's side
_RANK_FAILURES = (
    ray.exceptions.RayActorError,
    ray.exceptions.RayChannelError,
    ray.exceptions.GetTimeoutError,
)


class CompiledWorkerGroup(RayWorkerGroup):
    """The ranks behind one compiled graph: ``execute`` runs it once per step."""

    _graph: Any = None

    @property
    def _timeout(self) -> float:
        """The step timeout as the graph takes it (-1: none)."""
        return self.step_timeout_s if self.step_timeout_s is not None else -1

    def _on_ranks_ready(self) -> None:
        """Compile the graph for the ranks now serving (first, and after each restart); where
        that fails (a Ray without compiled graphs, say) the group goes on with plain calls,
        and says so."""
        try:
            self._graph = compile_fanout(self.workers, "execute_blob", self._timeout)
        except Exception as exc:
            log.warning("cannot compile the step graph (%s); using plain calls", exc)
            self._graph = None

    def _on_ranks_gone(self) -> None:
        self._teardown()

    @property
    def control_plane(self) -> str:
        return "graph" if self._graph is not None else "calls"

    @property
    def graph(self) -> Any:
        """The compiled graph now serving (None: on plain calls); its node is each rank's
        ``execute_blob``, its input an encoded plan."""
        return self._graph

    def submit(self, plan: StepPlan) -> StepHandle:
        """One execution of the graph; the handle's ``result`` gathers the replies, a rank that
        died or stayed silent past the step timeout reported in ``RankFailed`` with the
        others'."""
        if self._graph is None:
            return super().submit(plan)
        blob = wire.encode(plan)
        started = time.monotonic()
        try:
            refs = self._graph.execute(blob)  # one per rank
        except Exception as exc:  # the graph failed before the step ran: the result says how
            return SentStep(partial(self._gather_graph, plan.step, started, [], exc))
        return SentStep(partial(self._gather_graph, plan.step, started, refs))

    def _gather_graph(
        self, step: int, started: float, refs: list[Any], error: Exception | None = None
    ) -> list[StepReport]:
        """The ranks' replies to ``step`` (``error``: what sending it raised, judged the same
        way as a failed get)."""
        timeout = self._timeout
        try:
            if error is not None:
                raise error
            replies = [ref.get(timeout=self._left(started, timeout)) for ref in refs]
        except ray.exceptions.RayTaskError:
            raise  # the step itself raised on a rank: a bug, as with plain calls, not a death
        except _RANK_FAILURES as exc:
            self._failed(step, started, exc)
        return [wire.decode_report(r) for r in replies]

    def _failed(self, step: int, started: float, exc: Exception) -> NoReturn:
        """A death, a timeout (RayChannelTimeoutError), or the graph shut down by one: which
        ranks failed, from their own answers."""
        log.warning("step %d through the compiled graph failed: %s", step, exc)
        timeout = self._timeout
        left = None if timeout < 0 else self._left(started, timeout)
        reports, dead = self._ask_replies(step, left)
        if not dead:  # every rank answered: the failure was not a rank's
            raise exc
        raise RankFailed(dead, reports) from exc

    @staticmethod
    def _left(started: float, timeout: float) -> float:
        """What is left of a step's timeout (-1: none)."""
        return -1 if timeout < 0 else max(0.0, timeout - (time.monotonic() - started))

    def _ask_replies(self, step: int, wait_s: float | None) -> tuple[list[StepReport], list[int]]:
        """Every rank's reply to ``step`` by plain call: (the replies, the dead or silent). A
        rank without one is asked again until ``wait_s`` has passed (the rest of the step's
        timeout: a survivor of a peer's death may still be computing); one whose actor does not
        even answer the question within ``REPLY_ASK_S`` counts as silent."""
        deadline = time.monotonic() + (wait_s if wait_s is not None else REPLY_ASK_S)
        pending = set(range(self.num_ranks))
        replies: dict[int, StepReport] = {}
        dead: set[int] = set()
        while pending:
            refs = {self.workers[r].reply_to.remote(step): r for r in pending}
            ready, unanswered = ray.wait(list(refs), num_returns=len(refs), timeout=REPLY_ASK_S)
            for ref in unanswered:
                dead.add(refs[ref])
                pending.discard(refs[ref])
            for ref in ready:
                rank = refs[ref]
                try:
                    blob = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError):
                    dead.add(rank)
                    pending.discard(rank)
                    continue
                if blob is not None:
                    replies[rank] = wire.decode_report(blob)
                    pending.discard(rank)
            if pending and time.monotonic() >= deadline:
                break
            if pending:
                time.sleep(0.05)  # a survivor still computing the step: ask again shortly
        dead |= pending  # silent past the step timeout: treated as dead, and replaced
        return [replies[r] for r in sorted(replies)], sorted(dead)

    def _teardown(self) -> None:
        if self._graph is not None:
            with contextlib.suppress(Exception):
                self._graph.teardown()
            self._graph = None

    def shutdown(self) -> None:
        """Leave the graph: the ranks answer plain calls only from then on."""
        self._teardown()


def compile_fanout(workers: list[Any], method: str, timeout: float) -> Any:
    """A compiled graph whose one input goes to ``method`` of every worker and whose outputs
    are their results, one per worker; one execution in flight (the engine needs a step's
    reports before it plans the next)."""
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as payload:
        dag = MultiOutputNode([getattr(w, method).bind(payload) for w in workers])
    return dag.experimental_compile(_submit_timeout=timeout, _max_inflight_executions=1)
