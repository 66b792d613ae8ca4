"""Choosing the next token from a model's logits: greedy by default; temperature, top-k and
top-p with a per-request seed; the sampled token's log-probability and the top ones on request.

A seeded request draws each token from a generator seeded by (seed, position), so its tokens do
not depend on which other requests share its steps, nor on how its prompt was cut into chunks.
Log-probabilities are those of the model's own distribution (before temperature and
filtering), as vLLM reports them.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None
    logprobs: int = 0  # how many top log-probabilities to return besides the sampled one's
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(slots=True)
class Sample:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


def _generator(seed: int, position: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int) -> Sample:
    """The token to emit after ``position`` given its ``logits`` ``[vocab]``."""
    logits = logits.to(torch.float32)
    logprobs = torch.log_softmax(logits, dim=-1)
    # a positive temperature too small for float32 (it would divide by 0) is the limit of
    # sampling as the temperature goes to 0: greedy
    if params.greedy or float(torch.tensor(params.temperature, dtype=torch.float32)) == 0.0:
        token = int(torch.argmax(logits))
    else:
        # from the largest logit down: any positive temperature, however small, divides only
        # values <= 0, so nothing overflows to inf (inf - inf would make the softmax NaN)
        scaled = (logits - logits.max()) / params.temperature
        if params.top_k:
            kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1:
            ordered, order = torch.sort(probs, descending=True)
            # keep the smallest set whose mass reaches top_p (the first token always stays)
            outside = torch.cumsum(ordered, dim=-1) - ordered >= params.top_p
            ordered = ordered.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, ordered)
        if not bool(torch.isfinite(probs).all()):
            # logits the model got wrong (NaN): refused here, where a GPU's multinomial would
            # fail with a device-side assert that no caller can contain
            raise ValueError("the model's probabilities are not finite")
        seed = params.seed if params.seed is not None else torch.seed()
        token = int(torch.multinomial(probs, 1, generator=_generator(seed, position)))
    top: dict[int, float] = {}
    if params.logprobs:
        values, ids = torch.topk(logprobs, min(params.logprobs, logprobs.numel()))
        top = {int(i): float(v) for i, v in zip(ids, values, strict=True)}
    return Sample(token, float(logprobs[token]), top)
