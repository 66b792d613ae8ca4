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
    # its cache's tenant: requests with different salts never share a cached block
    cache_salt: str | None = None


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


# A trace replayed on the engine-step clock comes, by default, at this share of the rate the
# engine can serve: its bursts (several requests within a step) still find room, so time to first
# token is what the engine takes for a request, not an ever longer queue (at 100% or more the
# queue grows with the run's length, and a request's TTFT says more about how many came before it
# than about its prefill).
TRACE_LOAD = 0.5


@dataclass(slots=True, frozen=True)
class EngineCapacity:
    """What bounds how many requests an engine serves per step: its seats (``max_num_seqs``),
    its per-step token budget, and the tokens its GPU pool holds."""

    max_num_seqs: int
    max_num_batched_tokens: int
    pool_tokens: int  # GPU blocks times tokens per block, per KV group

    def requests_per_step(self, mean_prompt: float, mean_output: float) -> float:
        """Requests per step it serves in the long run: a request holds its seat for its output
        plus the prefill step, and its tokens of the budget and of the pool meanwhile."""
        per_request = mean_prompt + mean_output
        seats = min(self.max_num_seqs, self.pool_tokens / per_request)
        return min(seats / (mean_output + 1), self.max_num_batched_tokens / per_request)


def trace_requests(
    path: str | Path,
    *,
    vocab_size: int,
    num_requests: int | None = None,
    tokens_per_block: int = MOONCAKE_BLOCK_TOKENS,
    max_tokens: int | None = None,
    arrival_rate: float | None = None,
    capacity: EngineCapacity | None = None,
    seed: int = 0,
    time_scale: float | None = None,
    conversations: bool = False,
) -> list[RequestSpec]:
    """Requests from a Mooncake trace, with tokens derived from the hash ids.

    Arrivals keep the trace's own timestamps. With ``time_scale`` they are wall seconds times
    that factor (2: half the recorded rate). Otherwise they are engine steps, the trace's gaps
    scaled so that requests arrive at ``arrival_rate`` per step on average (0: all at once),
    by default ``TRACE_LOAD`` of what ``capacity`` serves (2 per step without one). The step
    clock makes a replay the same on any machine, and the same with the CPU tier and without.

    Each hash id stands for ``tokens_per_block`` tokens drawn from a generator seeded by the id,
    so equal ids give equal token blocks and shared prefixes in the trace are shared prefixes
    here. Lengths scale with ``tokens_per_block / 512`` (to replay big traces on small machines);
    output lengths are capped at ``max_tokens``.

    ``conversations``: the requests grouped into whole conversations (those sharing their first
    hash id), one conversation after another in the order each first appears, its turns in trace
    order, arriving one every ``1 / arrival_rate`` steps (so a turn finds the ones before it
    computed, as a user's next question would, where the rate leaves the engine the time).
    """
    trace = read_trace(path, limit=num_requests)
    order = list(range(len(trace)))
    if conversations:
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(trace):
            groups.setdefault(r.hash_ids[0] if r.hash_ids else -1 - i, []).append(i)
        order = [i for members in groups.values() for i in members]
        trace = [trace[i] for i in order]
    blocks: dict[int, list[int]] = {}
    scale = tokens_per_block / MOONCAKE_BLOCK_TOKENS

    def block(h: int) -> list[int]:
        toks = blocks.get(h)
        if toks is None:
            toks = _tokens(random.Random(h * 1_000_003 + seed), tokens_per_block, vocab_size)
            blocks[h] = toks
        return toks

    prompts: list[list[int]] = []
    outputs: list[int] = []
    for r in trace:
        n_full = r.input_length // MOONCAKE_BLOCK_TOKENS
        prompt = [t for h in r.hash_ids[:n_full] for t in block(h)]
        tail = int((r.input_length - n_full * MOONCAKE_BLOCK_TOKENS) * scale)
        if tail and len(r.hash_ids) > n_full:
            prompt += block(r.hash_ids[n_full])[:tail]
        if not prompt:
            prompt = block(r.hash_ids[0])[:1]
        prompts.append(prompt)
        out_len = max(1, r.output_length)
        outputs.append(out_len if max_tokens is None else min(out_len, max_tokens))
    first = min(r.timestamp for r in trace)
    if time_scale is not None:
        steps = [0.0] * len(trace)
        walls: list[float | None] = [(r.timestamp - first) / 1000.0 * time_scale for r in trace]
    else:
        if arrival_rate is None:
            arrival_rate = 2.0
            if capacity is not None:
                mean_prompt = sum(map(len, prompts)) / len(prompts)
                mean_output = sum(outputs) / len(outputs)
                arrival_rate = TRACE_LOAD * capacity.requests_per_step(mean_prompt, mean_output)
        if conversations:
            steps = [i / arrival_rate if arrival_rate > 0 else 0.0 for i in range(len(trace))]
        else:
            steps = _step_arrivals([r.timestamp for r in trace], arrival_rate)
        walls = [None] * len(trace)
    return [
        RequestSpec(f"trace-{i}", tuple(p), n, step, arrival_s=wall)
        for i, p, n, step, wall in zip(order, prompts, outputs, steps, walls, strict=True)
    ]


def _step_arrivals(timestamps: list[float], rate: float) -> list[float]:
    """The engine step at which each request arrives: the trace's gaps, scaled to ``rate``
    requests per step on average (0: all at once; a trace whose timestamps are all equal
    arrives at ``rate`` per step in its order)."""
    if rate <= 0:
        return [0.0] * len(timestamps)
    first, span = min(timestamps), max(timestamps) - min(timestamps)
    if span <= 0:
        return [i / rate for i in range(len(timestamps))]
    steps_per_ms = (len(timestamps) - 1) / (span * rate)
    return [(t - first) * steps_per_ms for t in timestamps]


def make_workload(cfg: RaykvConfig) -> list[RequestSpec]:
    """The requests ``cfg.workload`` describes."""
    w, vocab = cfg.workload, cfg.model.vocab_size
    if w.kind == "chat":
        raise ValueError("workload.kind chat is driven by the answers: see workload/chat.py")
    if w.kind == "trace":
        assert w.trace is not None
        c = cfg.cache
        capacity = EngineCapacity(
            cfg.engine.max_num_seqs,
            cfg.engine.max_num_batched_tokens,
            (c.num_gpu_blocks - 1) * c.block_size // len(c.groups),  # block 0 is the null block
        )
        return trace_requests(
            w.trace,
            vocab_size=vocab,
            num_requests=w.num_requests,
            tokens_per_block=w.trace_tokens_per_block,
            max_tokens=w.max_tokens,
            arrival_rate=w.arrival_rate,
            capacity=capacity,
            seed=w.seed,
            time_scale=w.trace_time_scale,
            conversations=w.trace_order == "conversations",
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
        arrival_rate=2.0 if w.arrival_rate is None else w.arrival_rate,
    )
