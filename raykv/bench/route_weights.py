"""``raykv bench route-weights``: the KV-aware router's weights, measured on the engine that
will serve (``serve.router_weights``; see ``raykv/serve/kv_router.py``).

On the one-process engine with the real model, each measured as a request's TTFT (fastest of
the repeats):

- computing: fresh prompts of two lengths; the slope is the cost of a computed prompt token;
- loading: the same prompts again once the GPU prefix cache is emptied, so the CPU tier serves
  them; the slope is the cost of a loaded token, and ``cpu_hit_cost`` its ratio to computing;
- decoding: the shorter fresh prompt arriving while ``k`` requests decode; what it takes
  longer than alone, per decoding request, in computed tokens, is ``decode_cost``.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from raykv.bench.ttft import LocalTTFTEngine
from raykv.config import RaykvConfig

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

    def ttft(self, prompt: list[int]) -> float:
        self.count += 1
        return self.first_token(f"w{self.count}", prompt)[0]


def measure_route_weights(
    cfg: RaykvConfig,
    prompt_tokens: tuple[int, int] = (256, 512),
    decoders: tuple[int, ...] = (8, 16),
    repeat: int = 3,
    seed: int = 0,
) -> RouteWeightsMeasurement:
    """Measure on ``cfg``'s model (configured: ``model.checkpoint.configure``, room made by
    ``bench.ttft.bench_config``)."""
    short, long = prompt_tokens
    engine = _Engine(cfg, seed)
    try:
        engine.ttft(engine.prompt(short))  # warm: the first step pays for allocations
        computed: dict[int, float] = {}
        loaded: dict[int, float] = {}
        for _ in range(repeat):
            for n in prompt_tokens:
                prompt = engine.prompt(n)
                t = engine.ttft(prompt)
                computed[n] = min(computed.get(n, t), t)
                engine.empty_gpu_cache()  # its stores land first: the CPU tier serves it now
                t = engine.ttft(prompt)
                loaded[n] = min(loaded.get(n, t), t)
        compute = (computed[long] - computed[short]) / (long - short)
        load = max(0.0, (loaded[long] - loaded[short]) / (long - short))
        delays: dict[int, float] = {}
        for k in decoders:
            best = min(engine.first_token_beside(k, engine.prompt(short)) for _ in range(repeat))
            delays[k] = max(0.0, best - computed[short])
        per_decoder = [delays[k] / k for k in decoders if k > 0]
        decode_cost = (sum(per_decoder) / len(per_decoder)) / compute if per_decoder else 0.0
        return RouteWeightsMeasurement(
            compute, load, delays, load / compute if compute > 0 else 0.0, decode_cost
        )
    finally:
        engine.close()
