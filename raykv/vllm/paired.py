"""vLLM's throughput with raykv's spec against without, measured in pairs.

A few percent is what is being measured, and on a shared machine one engine's run can be 10-20%
faster than the same engine's a minute later. So each contender (vLLM alone, with raykv's CPU
and disk tiers, with all three) is an engine in a process of its own, started once and idle
while another runs, and the batches are taken in turns, the order rotated each round: what the
machine's speed does over the run falls on every contender alike, and each round gives a ratio
of two batches run back to back. The ratio reported is the median of the rounds'.

A contender with raykv's spec counts its writes in its time: a batch ends when vLLM's requests
have and no store of raykv's is still being written (to the disk, into the store), stepped by
one-token requests, so no write of one batch runs during another contender's.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

START_S = 600.0  # an engine's start (an import of vLLM, a compile): the bench gives up after
BATCH_S = 900.0  # one batch, its writes included
STOP_S = 60.0  # an engine's shutdown once asked (a stuck one is killed)
# between the one-token steps that let a batch's last writes land: the cores are the writes'
# then, as an engine's are once its requests are done (stepped back to back, the steps' compute
# threads took them from the writes' threads, which run below the process's priority)
DRAIN_PAUSE_S = 0.005


class PairedError(RuntimeError):
    """A contender's engine failed to start or to run a batch (its message says why)."""


@dataclass(slots=True)
class Contender:
    """One engine of the comparison: ``raykv`` its settings (None: vLLM alone), ``extra`` the
    rest of its connector config."""

    name: str
    raykv: dict[str, Any] | None
    extra: dict[str, Any] | None = None


@dataclass(slots=True)
class Rounds:
    """Each contender's seconds per round (its batch and its writes)."""

    seconds: dict[str, list[float]] = field(default_factory=dict)

    def ratios(self, baseline: str, name: str) -> list[float]:
        """Per round: the baseline's time over the contender's (above 1: the contender was
        faster)."""
        return [b / c for b, c in zip(self.seconds[baseline], self.seconds[name], strict=True)]

    def ratio(self, baseline: str, name: str) -> float:
        return statistics.median(self.ratios(baseline, name))

    def median_s(self, name: str) -> float:
        return statistics.median(self.seconds[name])


def _serve(connection: Any, model: str, contender: Contender, engine_args: dict) -> None:
    """A contender's process: its engine, then one batch per message until ``None``."""
    from raykv.vllm.local import generate_s, local_engine, stores_landed, worker_of

    try:
        with local_engine(model, contender.raykv, contender.extra, **engine_args) as llm:
            generate_s(llm, [[1] * 64], 1)
            populator = worker_of(llm).populator if contender.raykv is not None else None
            if populator is not None:
                # ready once its CPU pool is resident: the start's work is none of a batch's
                # (its pages faulted in beside the first round cost that round up to 20%)
                populator.done.wait(START_S)
            connection.send(("ready", None))
            while (message := connection.recv()) is not None:
                prompts, output_tokens = message
                start = time.perf_counter()
                generate_s(llm, prompts, output_tokens)
                # its writes count in its time: none runs in another contender's batch
                if contender.raykv is not None and not stores_landed(
                    llm, lambda i: [2 + i % 1000], pause_s=DRAIN_PAUSE_S
                ):
                    raise RuntimeError("raykv's stores did not land within the bench's wait")
                connection.send(("done", time.perf_counter() - start))
    except Exception as exc:  # said to the bench, which stops the others
        connection.send(("failed", f"{type(exc).__name__}: {exc}"))
    finally:
        connection.close()


class _Engine:
    """A contender's process, and the bench's end of its pipe."""

    def __init__(self, model: str, contender: Contender, engine_args: dict) -> None:
        context = multiprocessing.get_context("spawn")  # vLLM's state is not forked
        self.name = contender.name
        self.connection, theirs = context.Pipe()
        self.process = context.Process(
            target=_serve,
            args=(theirs, model, contender, engine_args),
            name=f"raykv-bench-{contender.name}",
            daemon=True,
        )
        self.process.start()
        theirs.close()
        self.started = False

    def ready(self) -> None:
        """Take its answer to its start (``PairedError`` where it failed): called once it has
        one to read (it answers one batch of one token first)."""
        self._answer(START_S, "start")
        self.started = True

    def _answer(self, timeout_s: float, what: str) -> Any:
        if not self.connection.poll(timeout_s):
            raise PairedError(f"{self.name}: no answer to its {what} within {timeout_s:g} s")
        try:
            kind, value = self.connection.recv()
        except EOFError:
            raise PairedError(f"{self.name}: its process ended during its {what}") from None
        if kind == "failed":
            raise PairedError(f"{self.name}: {value}")
        return value

    def batch(self, prompts: list[list[int]], output_tokens: int) -> float:
        self.connection.send((prompts, output_tokens))
        return float(self._answer(BATCH_S, "batch"))

    def ask_to_stop(self) -> None:
        """Ask a started engine to shut down; one still starting is ended (SIGTERM): it would
        read the request only after its whole start and warm-up."""
        if not self.started:
            self.process.terminate()
            return
        with contextlib.suppress(BrokenPipeError, OSError):  # it ended already
            self.connection.send(None)

    def stop(self) -> None:
        """Wait for it to end (asked by ``ask_to_stop``), killed where it does not."""
        self.process.join(STOP_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self.connection.close()


def _wait_ready(engines: list[_Engine]) -> None:
    """Each engine's answer to its start, in the order they come: the first to fail stops the
    wait (``PairedError``), however long the others' starts would take."""
    pending = {engine.connection: engine for engine in engines}
    deadline = time.monotonic() + START_S
    while pending:
        left = deadline - time.monotonic()
        answered = multiprocessing.connection.wait(list(pending), timeout=max(0.0, left))
        if not answered:
            names = ", ".join(engine.name for engine in pending.values())
            raise PairedError(f"{names}: no answer to the start within {START_S:g} s")
        for connection in answered:
            pending.pop(connection).ready()


def paired_throughput(
    model: str,
    contenders: list[Contender],
    engine_args: dict[str, Any],
    batch_of: Callable[[str, int], list[list[int]]],
    rounds: int,
    output_tokens: int,
    say: Callable[[str], None] = lambda _: None,
    around: dict[str, Callable[[], float | None]] | None = None,
) -> tuple[Rounds, dict[str, float | None]]:
    """Each contender's seconds for ``rounds`` batches taken in turns (``batch_of(name,
    round)``: its prompts, none another contender has), and for each name in ``around``, what
    that reading (a process's CPU seconds) grew by over the contender's batches."""
    engines: list[_Engine] = []
    found = Rounds({c.name: [] for c in contenders})
    grew: dict[str, float | None] = dict.fromkeys(around or {}, 0.0)
    try:
        # started side by side, as they stop: an engine's start is mostly vLLM's import, which
        # waits on the disk and the interpreter as much as on a core
        say(f"throughput: starting {', '.join(c.name for c in contenders)}")
        for contender in contenders:
            engines.append(_Engine(model, contender, engine_args))
        _wait_ready(engines)
        for r in range(rounds):
            for engine in engines[r % len(engines) :] + engines[: r % len(engines)]:
                say(f"throughput: round {r + 1}/{rounds}, {engine.name}")
                read = (around or {}).get(engine.name)
                before = read() if read is not None else None
                found.seconds[engine.name].append(
                    engine.batch(batch_of(engine.name, r), output_tokens)
                )
                if read is not None:
                    after = read()
                    total = grew[engine.name]
                    grew[engine.name] = (
                        None
                        if total is None or before is None or after is None
                        else total + after - before
                    )
    finally:
        for engine in engines:  # never left behind, starting, compiling or done
            engine.ask_to_stop()
        for engine in engines:
            engine.stop()
    return found, grew
