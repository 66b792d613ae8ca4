"""Reader for request traces in the Mooncake JSONL format.

One JSON object per line: ``timestamp`` (ms), ``input_length`` and ``output_length`` (tokens),
``hash_ids`` (one id per ``block_tokens``-token prompt block, the last possibly partial, whose id
may be left out; at least one id; equal ids mean equal prefix blocks). Other fields are ignored.
Every problem is reported with its line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that cannot be used; the message names the file, line and field."""


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request of a trace."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def full_blocks(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> int:
        """How many of the prompt's blocks are full (only full blocks can be stored)."""
        return self.input_length // block_tokens


def _field(obj: dict, name: str, where: str, *, kind: type, minimum: float) -> int | float:
    if name not in obj:
        raise TraceError(f"{where}: missing field {name!r}")
    value = obj[name]
    ok_types = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, ok_types):
        raise TraceError(f"{where}: field {name!r} must be {kind.__name__}, got {value!r}")
    if value < minimum:
        raise TraceError(f"{where}: field {name!r} must be >= {minimum}, got {value!r}")
    return value


def parse_trace_line(
    line: str, where: str, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> TraceRequest:
    """Parse one JSONL line; ``where`` (file:line) prefixes any error."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    timestamp = _field(obj, "timestamp", where, kind=float, minimum=0)
    input_length = _field(obj, "input_length", where, kind=int, minimum=1)
    output_length = _field(obj, "output_length", where, kind=int, minimum=0)
    if "hash_ids" not in obj:
        raise TraceError(f"{where}: missing field 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids
    ):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of non-negative integers")
    # the last, partial block's id may be missing, but a prompt needs at least one id: its
    # tokens are derived from the ids
    lo, hi = max(1, input_length // block_tokens), math.ceil(input_length / block_tokens)
    if not lo <= len(ids) <= hi:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length {input_length}; expected "
            f"{hi} (one per {block_tokens}-token block)"
        )
    return TraceRequest(float(timestamp), int(input_length), int(output_length), tuple(ids))


def read_trace(
    path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS, limit: int | None = None
) -> list[TraceRequest]:
    """Read a whole trace (blank lines are skipped). Raises TraceError naming the bad line."""
    path = Path(path)
    out: list[TraceRequest] = []
    try:
        fh = path.open("rb")  # decoded line by line, so a bad byte is reported with its line
    except OSError as exc:
        raise TraceError(f"{path}: cannot open trace ({exc.strerror})") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(
                    f"{path}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start + 1})"
                ) from None
            if not line.strip():
                continue
            out.append(parse_trace_line(line, f"{path}:{lineno}", block_tokens))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise TraceError(f"{path}: trace has no requests")
    return out
