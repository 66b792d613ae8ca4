"""The synthetic model's sampler: a token from the ranks' checksums of the KV it read."""

from __future__ import annotations

from raykv.core.step import ModelEntry, StepReport, TokenLogprobs

_MASK64 = (1 << 64) - 1
_P61 = (1 << 61) - 1


def _mix(z: int) -> int:
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def combine(partials: list[int]) -> int:
    """The whole model's checksum from every rank's partial one (each rank holds some heads)."""
    return sum(partials) % _P61


def sample(checksum: int, position: int, vocab_size: int, eos_every: int) -> tuple[int, bool]:
    """The next token and whether it is EOS (the top id). Deterministic in its inputs, so the
    same KV always yields the same token and any corrupted block changes the output."""
    h = _mix(checksum * 0x9E3779B97F4A7C15 + position)
    if eos_every and h % eos_every == 0:
        return vocab_size - 1, True
    return (h >> 17) % (vocab_size - 1), False


def sample_batch(
    batch: list[ModelEntry], reports: list[StepReport], vocab_size: int, eos_every: int
) -> dict[int, tuple[int, bool]]:
    """Every sampling entry's token and whether it is EOS, by batch index, from the ranks'
    partial checksums of the KV it read."""
    sampled: dict[int, tuple[int, bool]] = {}
    for i, entry in enumerate(batch):
        if entry.samples:
            checksum = combine([r.samples[i] for r in reports])
            sampled[i] = sample(checksum, entry.end, vocab_size, eos_every)
    return sampled


def real_model_tokens(
    batch: list[ModelEntry], reports: list[StepReport], stop_token_ids: frozenset[int]
) -> tuple[dict[int, tuple[int, bool]], dict[int, TokenLogprobs]]:
    """A real model's ranks sampled the same token from the same logits: the first reply's
    token of each sampling entry and whether it ends its request, and its logprobs where the
    request asked for them."""
    first = min(reports, key=lambda r: r.rank)
    sampled: dict[int, tuple[int, bool]] = {}
    logprobs: dict[int, TokenLogprobs] = {}
    for i, entry in enumerate(batch):
        if not entry.samples:
            continue
        sampled[i] = (first.samples[i], first.samples[i] in stop_token_ids)
        found = first.logprobs[i] if i < len(first.logprobs) else None
        if found is not None:
            logprobs[i] = found
    return sampled, logprobs
