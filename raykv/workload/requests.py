"""Workloads as lists of requests: a synthetic multi-turn chat, or a Mooncake trace."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from raykv.config import RaykvConfig
from raykv.core.step import SamplingSpec
from raykv.workload.trace import MOONCAKE_BLOCK_TOKENS, read_trace


@dataclass(slots=True, frozen=True)
class RequestSpec:
    """A request before it enters the engine."""

    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: float  # engine step at which it arrives
    sampling: SamplingSpec | None = None  # a real model's sampling (None: greedy)
    arrival_s: float | None = None  # or: wall seconds after the run's first submission


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    # the top id is reserved for EOS
    return [rng.randrange(vocab - 1) for _ in range(n)]


def _around(rng: random.Random, mean: int) -> int:
    return max(1, int(rng.uniform(0.5, 1.5) * mean))


def synthetic_chat(
    num_requests: int,
    *,
    vocab_size: int,
    seed: int = 0,
    max_tokens: int = 24,
    system_prompts: int = 6,
    system_prompt_tokens: int = 192,
    user_tokens: int = 48,
    answer_tokens: int = 32,
    mean_turns: float = 4.0,
    concurrent_conversations: int = 12,
    arrival_rate: float = 2.0,
) -> list[RequestSpec]:
    """Multi-turn conversations over a few shared system prompts.

    Each turn's prompt is the conversation's history (system prompt, earlier user turns and the
    recorded answers) plus a new user message, so returning conversations share ever longer
    prefixes, and every conversation shares its system prompt with others (chosen with a skew
    toward the first prompts). Several conversations are open at once and take turns at random,
    so a conversation returns after others have passed through the cache. Seeded: the same
    arguments give the same requests.
    """
    rng = random.Random(seed)
    prompts = [
        _tokens(rng, _around(rng, system_prompt_tokens), vocab_size) for _ in range(system_prompts)
    ]
    weights = [1.0 / (i + 1) for i in range(system_prompts)]
    p_continue = 1.0 - 1.0 / mean_turns

    def new_conversation() -> list[int]:
        return list(rng.choices(prompts, weights)[0])

    open_convs = [new_conversation() for _ in range(concurrent_conversations)]
    out: list[RequestSpec] = []
    for i in range(num_requests):
        c = rng.randrange(len(open_convs))
        prompt = open_convs[c] + _tokens(rng, _around(rng, user_tokens), vocab_size)
        arrival = i / arrival_rate if arrival_rate > 0 else 0.0
        out.append(RequestSpec(f"req-{i}", tuple(prompt), max_tokens, arrival))
        if rng.random() < p_continue:
            open_convs[c] = prompt + _tokens(rng, _around(rng, answer_tokens), vocab_size)
        else:
            open_convs[c] = new_conversation()
    return out


def trace_requests(
    path: str | Path,
    *,
    vocab_size: int,
    num_requests: int | None = None,
    tokens_per_block: int = MOONCAKE_BLOCK_TOKENS,
    max_tokens: int | None = None,
    arrival_rate: float = 2.0,
    seed: int = 0,
    time_scale: float | None = None,
) -> list[RequestSpec]:
    """Requests from a Mooncake trace, with tokens derived from the hash ids.

    Arrivals: ``arrival_rate`` requests per engine step, or with ``time_scale`` the trace's own
    timestamps, in wall seconds multiplied by it (2: half the recorded rate).

    Each hash id stands for ``tokens_per_block`` tokens drawn from a generator seeded by the id,
    so equal ids give equal token blocks and shared prefixes in the trace are shared prefixes
    here. Lengths scale with ``tokens_per_block / 512`` (to replay big traces on small machines);
    output lengths are capped at ``max_tokens``.
    """
    trace = read_trace(path, limit=num_requests)
    blocks: dict[int, list[int]] = {}
    scale = tokens_per_block / MOONCAKE_BLOCK_TOKENS

    def block(h: int) -> list[int]:
        toks = blocks.get(h)
        if toks is None:
            toks = _tokens(random.Random(h * 1_000_003 + seed), tokens_per_block, vocab_size)
            blocks[h] = toks
        return toks

    out = []
    for i, r in enumerate(trace):
        n_full = r.input_length // MOONCAKE_BLOCK_TOKENS
        prompt = [t for h in r.hash_ids[:n_full] for t in block(h)]
        tail = int((r.input_length - n_full * MOONCAKE_BLOCK_TOKENS) * scale)
        if tail and len(r.hash_ids) > n_full:
            prompt += block(r.hash_ids[n_full])[:tail]
        if not prompt:
            prompt = block(r.hash_ids[0])[:1]
        out_len = max(1, r.output_length)
        if max_tokens is not None:
            out_len = min(out_len, max_tokens)
        arrival = i / arrival_rate if arrival_rate > 0 else 0.0
        wall = None
        if time_scale is not None:
            arrival, wall = 0.0, (r.timestamp - trace[0].timestamp) / 1000.0 * time_scale
        out.append(RequestSpec(f"trace-{i}", tuple(prompt), out_len, arrival, arrival_s=wall))
    return out


def make_workload(cfg: RaykvConfig) -> list[RequestSpec]:
    """The requests ``cfg.workload`` describes."""
    w, vocab = cfg.workload, cfg.model.vocab_size
    if w.kind == "chat":
        raise ValueError("workload.kind chat is driven by the answers: see workload/chat.py")
    if w.kind == "trace":
        assert w.trace is not None
        return trace_requests(
            w.trace,
            vocab_size=vocab,
            num_requests=w.num_requests,
            tokens_per_block=w.trace_tokens_per_block,
            max_tokens=w.max_tokens,
            arrival_rate=w.arrival_rate,
            seed=w.seed,
            time_scale=w.trace_time_scale,
        )
    return synthetic_chat(
        w.num_requests,
        vocab_size=vocab,
        seed=w.seed,
        max_tokens=w.max_tokens,
        system_prompts=w.system_prompts,
        system_prompt_tokens=w.system_prompt_tokens,
        user_tokens=w.user_tokens,
        answer_tokens=w.answer_tokens,
        mean_turns=w.mean_turns,
        concurrent_conversations=w.concurrent_conversations,
        arrival_rate=w.arrival_rate,
    )
