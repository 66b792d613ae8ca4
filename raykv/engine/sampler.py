"""The synthetic model's sampler: a token from the ranks' checksums of the KV it read."""

from __future__ import annotations

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
