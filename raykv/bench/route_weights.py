"""``raykv bench route-weights``: the KV-aware router's weights, measured on the engine that
will serve (``serve.router_weights``; see ``raykv/serve/kv_router.py``).

On the one-process engine with the real model, each measured as a request's TTFT (fastest of
the repeats):

- computing: fresh prompts of two lengths; the slope is the cost of a computed prompt token;
- loading: the same prompts again once the GPU prefix cache is emptied, so the CPU tier serves
  them; the slope is the cost of a loaded token, and ``cpu_hit_cost`` its ratio to computing;
- from disk (with a disk tier: ``offload.disk.enabled``): the same prompts a third time once the
  CPU tier was moved to disk entirely (``EngineCore.spill_to_disk``) and the GPU cache emptied
  again, so their chunks are read from files, promoted into the CPU tier and then loaded; the
  slope is the cost of a token from disk, and ``disk_hit_cost`` its ratio to computing. Every
  hit is loaded (``bench.ttft.bench_config`` sets ``offload.take_hits: always``): the tiers
  are measured, not the scheduler's choice of them;
- from the shared tier (with ``offload.shared.enabled``): the same prompts on a second engine
  (a CPU tier of its own, the same store), which finds them in the store, reads them into its
  CPU tier and loads them; the slope is the cost of a token from the store, and
  ``shared_hit_cost`` its ratio to computing;
- decoding: the shorter fresh prompt arriving while ``k`` requests decode; what it takes
  longer than alone, per decoding request, in computed tokens, is ``decode_cost``.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from raykv.bench.ttft import LocalTTFTEngine
from raykv.config import RaykvConfig, load_config

DECODER_PROMPT_TOKENS = 32
# enough to be still decoding when the probe's first token comes (they are aborted then)
DECODER_MAX_TOKENS = 64


@dataclass(slots=True)
class RouteWeightsMeasurement:
    """The slopes (seconds per token) and the weights they give."""

    compute_s_per_token: float
    load_s_per_token: float
    decode_delay_s: dict[int, float]  # decoding requests -> the prompt's extra TTFT
    cpu_hit_cost: float
    decode_cost: float
    # from disk: promoted into the CPU tier, then loaded (None: no disk tier was measured)
    disk_s_per_token: float | None = None
    disk_hit_cost: float | None = None
    # from the shared tier, on another engine (None: no shared tier was measured)
    shared_s_per_token: float | None = None
    shared_hit_cost: float | None = None
    # each way's fastest TTFT per prompt length (what the slopes come from)
    ttft_s: dict[str, dict[int, float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Engine(LocalTTFTEngine):
    """``raykv bench ttft``'s local engine, with fresh prompts and requests that decode
    beside a probe (``first_token`` runs a prompt alone, after every earlier request)."""

    def __init__(self, cfg: RaykvConfig, seed: int) -> None:
        super().__init__(cfg)
        self.rng = random.Random(seed)
        self.vocab = cfg.model.vocab_size
        self.count = 0

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab - 1) for _ in range(n)]

    def _request(self, prompt: list[int], max_tokens: int) -> Any:
        from raykv.core.request import Request

        self.count += 1
        req = Request(f"w{self.count}", self.count, prompt, max_tokens)
        self.engine.add_request(req)
        return req

    def first_token_beside(self, k: int, prompt: list[int]) -> float:
        """The prompt's TTFT while ``k`` fresh requests decode (aborted after)."""
        while self.engine.has_work():
            self.engine.step()
        prompts = [self.prompt(DECODER_PROMPT_TOKENS) for _ in range(k)]
        running = [self._request(p, DECODER_MAX_TOKENS) for p in prompts]
        while any(not r.output for r in running):  # every one past its prefill
            self.engine.step()
        probe = self._request(prompt, 1)
        while not probe.finished:
            self.engine.step()
        for r in running:
            self.engine.abort(r.req_id)
        record = self.engine.latency.record_of(probe.req_id)
        assert record is not None
        return record.ttft_s

    def ttft(self, prompt: list[int], tier: str | None = None) -> float:
        """The prompt's TTFT; ``tier`` (``cpu`` or ``disk``): the tier its hit must have come
        from, whole (a hit from the other tier would be measured as this one's)."""
        self.count += 1
        req_id = f"w{self.count}"
        ttft, _ = self.first_token(req_id, prompt)
        if tier is not None:
            record = self.engine.latency.record_of(req_id)
            assert record is not None
            hits = {
                "cpu": record.cpu_hit_tokens,
                "disk": record.disk_hit_tokens,
                "shared": record.shared_hit_tokens,
            }
            if hits[tier] == 0 or any(n for other, n in hits.items() if other != tier):
                found = ", ".join(f"{n} from the {where} tier" for where, n in hits.items())
                raise RuntimeError(
                    f"{len(prompt)} tokens: {found}, where the {tier} tier alone should have "
                    "served it (are the tiers large enough for the prompts?)"
                )
        return ttft

    def ttft_from_disk(self, prompt: list[int]) -> float:
        """The prompt's TTFT once its chunks are only on disk: the CPU tier moved to disk and
        the GPU cache emptied first."""
        self.spill_to_disk()
        self.empty_gpu_cache()
        return self.ttft(prompt, "disk")


def _slope(ttft: dict[int, float], short: int, long: int) -> float:
    """Seconds per prompt token between the two lengths (never below 0: a load's noise can
    outweigh its few microseconds a token)."""
    return max(0.0, (ttft[long] - ttft[short]) / (long - short))


def measure_route_weights(
    cfg: RaykvConfig,
    prompt_tokens: tuple[int, int] = (256, 512),
    decoders: tuple[int, ...] = (8, 16),
    repeat: int = 3,
    seed: int = 0,
) -> RouteWeightsMeasurement:
    """Measure on ``cfg``'s model (configured: ``model.checkpoint.configure``, room made by
    ``bench.ttft.bench_config``; with ``offload.disk.enabled``, ``disk_hit_cost`` too; with
    ``offload.shared.enabled``, ``shared_hit_cost`` on a second engine)."""
    short, long = prompt_tokens
    disk = cfg.offload.disk.enabled
    engine = _Engine(cfg, seed)
    reader: _Engine | None = None
    try:
        engine.ttft(engine.prompt(short))  # warm: the first step pays for allocations
        if cfg.offload.shared.enabled:  # the other engine: the store, no disk tier of its own
            tree = cfg.model_dump(mode="json")
            tree["offload"]["disk"]["enabled"] = False
            reader = _Engine(load_config(tree), seed + 1)
            reader.ttft(reader.prompt(short))
        ways = ["computed", "cpu_tier", *(["disk_tier"] if disk else [])]
        ways += ["shared_tier"] if reader is not None else []
        best: dict[str, dict[int, float]] = {way: {} for way in ways}

        def keep(way: str, n: int, t: float) -> None:
            best[way][n] = min(best[way].get(n, t), t)

        for _ in range(repeat):
            for n in prompt_tokens:
                prompt = engine.prompt(n)
                keep("computed", n, engine.ttft(prompt))
                engine.empty_gpu_cache()  # its stores land first: the CPU tier serves it now
                keep("cpu_tier", n, engine.ttft(prompt, "cpu"))
                if disk:
                    keep("disk_tier", n, engine.ttft_from_disk(prompt))
                if reader is not None:
                    engine.empty_gpu_cache()  # every publish of the first engine has landed
                    keep("shared_tier", n, reader.ttft(prompt, "shared"))
        computed = best["computed"]
        compute = (computed[long] - computed[short]) / (long - short)
        load = _slope(best["cpu_tier"], short, long)
        from_disk = _slope(best["disk_tier"], short, long) if disk else None
        from_store = _slope(best["shared_tier"], short, long) if reader is not None else None
        delays: dict[int, float] = {}
        for k in decoders:
            probe = min(engine.first_token_beside(k, engine.prompt(short)) for _ in range(repeat))
            delays[k] = max(0.0, probe - computed[short])
        per_decoder = [delays[k] / k for k in decoders if k > 0]
        decode_cost = (sum(per_decoder) / len(per_decoder)) / compute if per_decoder else 0.0

        def ratio(seconds: float) -> float:
            return seconds / compute if compute > 0 else 0.0

        return RouteWeightsMeasurement(
            compute,
            load,
            delays,
            ratio(load),
            decode_cost,
            from_disk,
            ratio(from_disk) if from_disk is not None else None,
            from_store,
            ratio(from_store) if from_store is not None else None,
            best,
        )
    finally:
        engine.close()
        if reader is not None:
            reader.close()
