"""Whether a tier hit is worth loading: the first token's predicted time with the load, against
recomputing the same tokens.

A load is not free. Where the ranks copy beside the model (a copy thread, CUDA streams) the
request waits for every rank's ack, a step at least, before it computes the rest of its prompt;
where they copy at the step's transfer points (a real model on CPU ranks) the copy adds its time
to the step. A chunk from the disk tier is first promoted into the CPU tier (more steps of
waiting), then loaded. For a short prefix all of that can take longer than computing it: on a
held-out multi-turn trace the CPU tier made the mean TTFT 1.09x *worse* at a low arrival rate,
and SGLang's file tier was slower than recompute at 8K and 128K tokens (sglang #26305).

So each tier's cost is measured, from its own recent jobs, and so is the model's:

- a load from the CPU tier: seconds per block of the ranks' copies where a load lands in its own
  step (``offload.load_in_step``), else the wall time from planning the job to its last ack,
  ``a + b * blocks``;
- a promotion from the disk tier: the same wall time, ``a + b * blocks``;
- the model's prefill: the slowest rank's model time per step against the tokens it computed
  and their attention work, ``c1 * tokens + c2 * sum(context)`` (least squares over recent
  steps; per token alone where the steps do not tell the two apart);
- a step's own time besides the prefill it computes (the decodes beside it, sampling, the
  control plane): the period between steps less the prefill fit's share, a moving average.
  A prompt of R tokens computes in ``ceil(R / max_num_batched_tokens)`` steps at the least, and
  its first token comes after them, so each path pays that many of these.

``choose`` takes, of recomputing, loading what the CPU tier holds, and loading that and what
only the disk holds, the one whose first token comes soonest, and counts each tier hit it passes
over as ``skipped_slower``. A tier whose hits are being skipped still has one in
``PROBE_EVERY`` of them loaded, so its estimate follows the machine.

Before a tier has ``MIN_SAMPLES`` measured jobs, a move from it is priced by a prior: a whole
step (the median of the recent steps that computed tokens, each timed from its plan to its
replies; two with async scheduling, whose acks come a step late), the least a load that waits
for its acks delays its request, and a promotion the same before its load; a CPU-tier load that
lands in its own step adds its copies to that step, cheap beside a prefill, and is priced at
nothing. That is a lower bound, so a hit the prior passes over is surely slower than recomputing.
Taking every hit until four had been measured cost the first ones dearly where prefill is
cheap: on an H200 (a 135M model, 120-170-token prompts) the requests of the first CPU-tier hits
had 1.44x the TTFT they had without the tier, a load there delaying its request 40 ms against a
29 ms step.
The probes measure a tier the prior passes over. Before the model has ``MIN_SAMPLES`` steps
(and one step is timed) nothing can be priced, and hits are taken.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

from raykv.connector.jobs import TransferJobStatus
from raykv.core.step import StepReport

MIN_SAMPLES = 4
PROBE_EVERY = 16
WINDOW = 128  # recent observations each fit keeps


@dataclass(slots=True)
class Candidate:
    """A way to get a request's prompt KV: load up to ``end`` tokens (blocks from each tier),
    then compute from ``end``."""

    end: int
    cpu_blocks: int = 0
    disk_blocks: int = 0
    shared_blocks: int = 0


class LineFit:
    """``y = a + b * x`` by least squares over the latest ``WINDOW`` points (``a, b >= 0``)."""

    def __init__(self) -> None:
        self.points: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self._cached: tuple[float, float] | None = None

    def add(self, x: float, y: float) -> None:
        self.points.append((x, y))
        self._cached = None

    def __len__(self) -> int:
        return len(self.points)

    def coefficients(self) -> tuple[float, float]:
        if self._cached is None:
            self._cached = _line(self.points)
        return self._cached

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


def _line(points: deque[tuple[float, float]]) -> tuple[float, float]:
    n = len(points)
    if n == 0:
        return 0.0, 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= 1e-12 * max(1.0, mx * mx):  # one size only: all of it is the fixed part's
        return max(0.0, my), 0.0
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    if b < 0:  # bigger is never cheaper: the mean, as a fixed cost
        return max(0.0, my), 0.0
    a = my - b * mx
    if a < 0:  # no negative fixed cost: through the origin
        return 0.0, max(0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points))
    return a, b


class PrefillFit:
    """The model's seconds for a step against its tokens and their attention work."""

    def __init__(self) -> None:
        self.points: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)
        self._cached: tuple[float, float] | None = None

    def add(self, tokens: int, attention: float, seconds: float) -> None:
        if tokens > 0:
            self.points.append((float(tokens), attention, seconds))
            self._cached = None

    def __len__(self) -> int:
        return len(self.points)

    def coefficients(self) -> tuple[float, float]:
        """``(c1, c2)``: seconds per token, and per token per position it attends over."""
        if self._cached is None:
            self._cached = _plane(self.points)
        return self._cached

    def predict(self, start: int, end: int) -> float:
        """Seconds to compute positions ``start .. end - 1`` of one request."""
        if end <= start:
            return 0.0
        c1, c2 = self.coefficients()
        n = end - start
        return c1 * n + c2 * n * (start + end - 1) / 2


def _plane(points: deque[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares through the origin of ``s = c1 * t + c2 * a``; per token alone where the
    points cannot separate the two or give a negative part."""
    stt = sum(t * t for t, _, _ in points)
    if stt <= 0:
        return 0.0, 0.0
    per_token = sum(t * s for t, _, s in points) / stt
    saa = sum(a * a for _, a, _ in points)
    sta = sum(t * a for t, a, _ in points)
    det = stt * saa - sta * sta
    if det <= 1e-9 * stt * max(saa, 1e-30):
        return max(0.0, per_token), 0.0
    sts = sum(t * s for t, _, s in points)
    sas = sum(a * s for _, a, s in points)
    c1 = (sts * saa - sas * sta) / det
    c2 = (stt * sas - sta * sts) / det
    if c1 < 0 or c2 < 0:
        return max(0.0, per_token), 0.0
    return c1, c2


@dataclass(slots=True)
class Decision:
    """What ``choose`` decided for one lookup: the candidate taken, and the predicted seconds
    to compute the prompt from there and by recomputing everything after what the GPU holds
    (None while the model is not measured yet: nothing was predicted)."""

    end: int
    predicted_s: float | None
    recompute_s: float | None
    # the longest the request may wait for what the chosen option waits on (its promotions,
    # chunks still being written, room in the CPU tier) before the best option that loads
    # less would have given the first token sooner (None: not priced)
    wait_s: float | None = None


class TierCosts:
    """The measured costs of the tiers and of the model, and the choice they make.
    ``step_tokens``: the most tokens a step computes (``engine.max_num_batched_tokens``);
    ``min_samples``: the observations a fit needs before it prices anything."""

    def __init__(
        self,
        step_tokens: int,
        load_in_step: bool = False,
        ack_steps: int = 1,
        min_samples: int = MIN_SAMPLES,
    ) -> None:
        self.step_tokens = step_tokens
        self.min_samples = min_samples
        self.load_in_step = load_in_step  # CPU-tier loads land in their own step
        self.ack_steps = ack_steps  # steps until a job's acks are seen (2: async scheduling)
        self.cpu = LineFit()  # seconds a CPU-tier load delays its request, by blocks
        self.disk = LineFit()  # seconds a promotion from disk takes, by blocks
        self.shared = LineFit()  # seconds a promotion from the shared store takes, by blocks
        self.prefill = PrefillFit()
        self.step_s = 0.0  # a step's time besides its prefill (moving average)
        self.durations: deque[float] = deque(maxlen=WINDOW)  # recent busy steps, plan to replies
        self._last_step: float | None = None
        self._ended: float | None = None  # when the last step's replies came in
        self._busy = False  # ... and whether it computed tokens
        self.skipped_slower = {"cpu": 0, "disk": 0, "shared": 0}
        self.probes = {"cpu": 0, "disk": 0, "shared": 0}
        self._skips = {"cpu": 0, "disk": 0, "shared": 0}

    # ---- what was measured -----------------------------------------------------------------

    def observe_step(
        self, tokens: int, attention: float, model_seconds: float, period_s: float | None = None
    ) -> None:
        """One step's model work: the tokens computed, their attention work (sum over them of
        the positions each attends over), the slowest rank's model seconds, and the seconds
        since the step before ended (None: the first)."""
        self.prefill.add(tokens, attention, model_seconds)
        if period_s is not None and tokens > 0:
            c1, c2 = self.prefill.coefficients()
            rest = max(0.0, period_s - c1 * tokens - c2 * attention)
            self.step_s += (rest - self.step_s) * (0.05 if self._last_step is not None else 1.0)
            self._last_step = period_s

    def observe_duration(self, seconds: float) -> None:
        """A step that computed tokens took ``seconds`` from its plan to its replies."""
        self.durations.append(seconds)

    @property
    def step_period_s(self) -> float:
        """A step, as the prior counts it: the median of the recent busy ones (a cold first
        step or one stalled by a dead rank does not move it)."""
        return statistics.median(self.durations) if self.durations else 0.0

    def observe_reports(
        self, tokens: int, attention: float, reports: list[StepReport], load_in_step: bool
    ) -> None:
        """A step's replies: the slowest rank's model time for the step's work, and where loads
        land in their own step, the slowest rank's copies of them."""
        if not reports:
            return
        now = time.perf_counter()
        # a step after an idle one may follow a pause for arrivals: not a step's own time
        period = now - self._ended if self._ended is not None and self._busy else None
        self._ended, self._busy = now, tokens > 0
        self.observe_step(tokens, attention, max(r.model_s for r in reports), period)
        if load_in_step:
            copies = max((r.transfers.stats for r in reports), key=lambda t: t.load_seconds)
            self.observe_load(copies.load_blocks, copies.load_seconds)

    def observe_load(self, blocks: int, seconds: float) -> None:
        """A CPU-tier load of ``blocks`` delayed its request ``seconds``."""
        if blocks > 0:
            self.cpu.add(blocks, seconds)

    def observe_promotion(self, blocks: int, seconds: float) -> None:
        if blocks > 0:
            self.disk.add(blocks, seconds)

    def observe_job(self, job: TransferJobStatus, bpc: int, load_in_step: bool) -> None:
        """A job became final: a successful load (where loads wait for their acks: one landing
        in its own step is measured by its copies, ``observe_load`` per step) or promotion
        measures its tier by its wall time since it was planned."""
        if job.failed or (job.is_store and not job.move):
            return
        seconds = time.perf_counter() - job.created_s
        if job.move == "promote":
            self.observe_promotion(len(job.keys) * bpc, seconds)
        elif job.move == "fetch":
            self.shared.add(len(job.keys) * bpc, seconds)
        elif not job.move and not load_in_step:
            self.observe_load(len(job.keys) * bpc, seconds)

    # ---- the choice ------------------------------------------------------------------------

    def measured(self, tier: str) -> bool:
        return len(self._fit(tier)) >= self.min_samples

    def _fit(self, tier: str) -> LineFit:
        return {"cpu": self.cpu, "disk": self.disk, "shared": self.shared}[tier]

    def move_s(self, tier: str, blocks: int) -> float:
        """Predicted seconds a move of ``blocks`` from ``tier`` delays its request: the tier's
        fit once measured, the prior before (the module's docstring)."""
        if self.measured(tier):
            return self._fit(tier).predict(blocks)
        if tier == "cpu" and self.load_in_step:
            return 0.0
        return self.ack_steps * self.step_period_s

    def cost(self, start: int, prompt: int, option: Candidate) -> float:
        """Predicted seconds until ``option`` has computed the prompt's last token."""
        begin = max(start, option.end)
        steps = max(1, -(-(prompt - begin) // self.step_tokens))
        seconds = steps * self.step_s + self.prefill.predict(begin, prompt)
        blocks = option.cpu_blocks + option.disk_blocks + option.shared_blocks
        if blocks:
            seconds += self.move_s("cpu", blocks)
        return seconds + self._promotions_s(option)

    def _promotions_s(self, option: Candidate) -> float:
        """Predicted seconds of ``option``'s promotions from the tiers below: the two tiers'
        run side by side, so the slower one is waited for."""
        return max(
            self.move_s("disk", option.disk_blocks) if option.disk_blocks else 0.0,
            self.move_s("shared", option.shared_blocks) if option.shared_blocks else 0.0,
        )

    def priced(self) -> bool:
        """Whether the model is measured: a recompute can be priced."""
        return len(self.prefill) >= self.min_samples and bool(self.durations)

    def choose(self, start: int, prompt: int, options: list[Candidate]) -> Decision:
        """Of recomputing from ``start`` (what the GPU holds) to the prompt's end and the
        ``options`` (each loading further than the one before: the CPU tier's hit, then the
        disk's beyond it), the soonest first token. A tier not yet measured is priced by the
        prior; before the model is measured, the furthest option is taken as it comes."""
        recompute = self.cost(start, prompt, Candidate(start))
        if not options:
            return Decision(start, recompute, recompute)
        if not self.priced():
            return Decision(options[-1].end, None, None)
        best_end, best_s = start, recompute
        priced = [(o, self.cost(start, prompt, o)) for o in options]
        for option, seconds in priced:
            if seconds < best_s:
                best_end, best_s = option.end, seconds
        wait_s = self._wait_s(start, recompute, priced, best_end)
        best = Decision(best_end, best_s, recompute, wait_s)
        passed = [(o, s) for o, s in priced if o.end > best_end]
        for tier in dict.fromkeys(_tier(o) for o, _ in passed):
            # passed over: one in PROBE_EVERY is taken anyway, to keep measuring the tier
            self._skips[tier] += 1
            if self._skips[tier] % PROBE_EVERY == 0:
                self.probes[tier] += 1
                option, seconds = next((o, s) for o, s in reversed(passed) if _tier(o) == tier)
                # a probe waits for its tier as long as any wait may last: what it measures
                # is the tier's whole time
                return Decision(option.end, seconds, recompute, None)
            self.skipped_slower[tier] += 1
        return best

    def _wait_s(
        self,
        start: int,
        recompute: float,
        priced: list[tuple[Candidate, float]],
        end: int,
    ) -> float | None:
        """How long the option ending at ``end`` may wait before its first token would come
        later than the soonest option that loads less (recomputing at worst): that one's
        predicted seconds, less what the chosen one takes once its wait is over (its moves
        from the tiers below are the wait)."""
        if end <= start:
            return None
        option, chosen = next((o, s) for o, s in priced if o.end == end)
        fallback = min([recompute, *(s for o, s in priced if o.end < end)])
        return max(0.0, fallback - (chosen - self._promotions_s(option)))

    def summary(self) -> dict[str, float]:
        """The current estimates, for the report."""
        a_cpu, b_cpu = self.cpu.coefficients()
        a_disk, b_disk = self.disk.coefficients()
        a_shared, b_shared = self.shared.coefficients()
        c1, c2 = self.prefill.coefficients()
        return {
            "cpu_load_fixed_s": a_cpu,
            "cpu_load_s_per_block": b_cpu,
            "disk_promotion_fixed_s": a_disk,
            "disk_promotion_s_per_block": b_disk,
            "shared_promotion_fixed_s": a_shared,
            "shared_promotion_s_per_block": b_shared,
            "prefill_s_per_token": c1,
            "prefill_s_per_token_position": c2,
            "step_s_besides_prefill": self.step_s,
            "step_period_s": self.step_period_s,
        }


def _tier(option: Candidate) -> str:
    """The deepest tier an option loads from."""
    if option.shared_blocks:
        return "shared"
    return "disk" if option.disk_blocks else "cpu"
