"""The building blocks of every config section: the error that names a key path, sizes with
units, and the strict base model (unknown keys are errors)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
)


class ConfigError(ValueError):
    """A configuration problem; the message names each key path at fault and its value."""


def whole_chunks(size: int, chunk: int, key: str, what: str, across: str) -> int:
    """How many chunks of ``chunk`` bytes a tier of ``size`` bytes holds; ``ConfigError``
    naming ``key`` where it holds none (``what`` a chunk is, ``across`` how many share it)."""
    if size < chunk:
        raise ConfigError(f"{key} ({size}) is smaller than {what} ({chunk} bytes across {across})")
    return size // chunk


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as ``2GiB``, ``512 MiB``, ``1.5GB``."""
    if isinstance(value, bool):
        raise ValueError("expected a size, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError("not a size; use bytes or a number with a unit such as 512MiB or 2GiB")


ByteSize = Annotated[int, BeforeValidator(parse_size)]
_POLICY_RE = re.compile(r"^([A-Za-z_][\w-]*|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
