"""Reader for request traces in the Mooncake JSONL format.

One JSON object per line: ``timestamp`` (ms), ``input_length`` and ``output_length`` (tokens),
``hash_ids`` (one id per ``block_tokens``-token prompt block, the last possibly partial, whose id
may be left out; at least one id; equal ids mean equal prefix blocks). Other fields are ignored.
Numbers must be finite and of their field's kind and range (see ``MAX_LENGTH`` and the other
bounds). Every problem is reported with its line and field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from raykv.error_text import reason, shown

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


# Past these a number is poison, not a trace's: a millisecond timestamp beyond 2**53 is no
# longer exact in a float (and a replay on the wall clock would wait ages for it), no prompt or
# answer is 2**31 tokens long, and a hash id is a 64-bit hash.
MAX_TIMESTAMP_MS = 2**53
MAX_LENGTH = 2**31 - 1
MAX_HASH_ID = 2**64 - 1


def _field(
    obj: dict, name: str, where: str, *, kind: type, minimum: int, maximum: int
) -> int | float:
    if name not in obj:
        raise TraceError(f"{where}: missing field {name!r}")
    value = obj[name]
    ok_types = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, ok_types):
        raise TraceError(f"{where}: field {name!r} must be {kind.__name__}, got {shown(value)}")
    # json reads NaN, Infinity and 1e999 as floats; every comparison with NaN is false
    if isinstance(value, float) and not math.isfinite(value):
        raise TraceError(f"{where}: field {name!r} must be a finite number, got {value!r}")
    if value < minimum:
        raise TraceError(f"{where}: field {name!r} must be >= {minimum}, got {shown(value)}")
    if value > maximum:
        raise TraceError(f"{where}: field {name!r} must be <= {maximum}, got {shown(value)}")
    return value


def _hash_ids(obj: dict, where: str) -> tuple[int, ...]:
    if "hash_ids" not in obj:
        raise TraceError(f"{where}: missing field 'hash_ids'")
    ids = obj["hash_ids"]
    wanted = f"{where}: field 'hash_ids' must be a list of non-negative integers below 2**64"
    if not isinstance(ids, list):
        raise TraceError(f"{wanted}, got {shown(ids)}")
    for index, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_HASH_ID:
            raise TraceError(f"{wanted}; hash_ids[{index}] is {shown(h)}")
    return tuple(ids)


def parse_trace_line(
    line: str, where: str, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> TraceRequest:
    """Parse one JSONL line; ``where`` (file:line) prefixes any error."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:  # a number of too many digits, too deep a nest
        raise TraceError(f"{where}: not valid JSON ({reason(exc)})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    timestamp = _field(obj, "timestamp", where, kind=float, minimum=0, maximum=MAX_TIMESTAMP_MS)
    input_length = _field(obj, "input_length", where, kind=int, minimum=1, maximum=MAX_LENGTH)
    output_length = _field(obj, "output_length", where, kind=int, minimum=0, maximum=MAX_LENGTH)
    ids = _hash_ids(obj, where)
    # the last, partial block's id may be missing, but a prompt needs at least one id: its
    # tokens are derived from the ids (integer division: a length is never a float's)
    lo, hi = max(1, input_length // block_tokens), -(-input_length // block_tokens)
    if not lo <= len(ids) <= hi:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length {input_length}; expected "
            f"{hi} (one per {block_tokens}-token block)"
        )
    return TraceRequest(float(timestamp), int(input_length), int(output_length), ids)


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
