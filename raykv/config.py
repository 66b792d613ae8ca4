"""The YAML configuration: pydantic models with strict validation.

Unknown keys are errors, and every error names the offending key path and the value found there,
e.g. ``offload.cpu_bytes: not a size ... (got '2XB')``. Sizes accept plain integers (bytes) or a
number with a unit: ``512KiB``, ``2GiB``, ``1.5GB``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = [
    "ConfigError",
    "OffloadConfig",
    "RaykvConfig",
    "apply_overrides",
    "load_config",
    "parse_size",
]


class ConfigError(ValueError):
    """A configuration problem; the message names each key path at fault and its value."""


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


class OffloadConfig(_Strict):
    """The CPU tier."""

    enabled: bool = True
    cpu_bytes: ByteSize | None = Field(
        default=None, description="CPU tier size in bytes across all ranks (e.g. 8GiB)."
    )
    cpu_slots: int | None = Field(
        default=None, gt=0, description="CPU tier size in chunks; exclusive with cpu_bytes."
    )
    blocks_per_chunk: int = Field(default=1, gt=0, description="GPU blocks per CPU chunk.")
    policy: str = Field(
        default="recall",
        description="Eviction policy: a registered name (lru, arc, recall) or module:Class.",
    )
    store_threshold: int = Field(
        default=0, ge=0, description="Store only chunks looked up this often (>= 2 enables)."
    )
    max_tracker_size: int = Field(
        default=64_000, gt=0, description="Keys remembered by the store_threshold filter."
    )
    events: bool = Field(default=True, description="Emit BlockStored/BlockRemoved KV events.")

    @field_validator("policy")
    @classmethod
    def _policy_spec(cls, value: str) -> str:
        if not _POLICY_RE.match(value):
            raise ValueError("neither a policy name nor a module:Class import path")
        return value

    @model_validator(mode="after")
    def _one_size(self) -> OffloadConfig:
        if self.cpu_bytes is not None and self.cpu_slots is not None:
            raise ValueError(
                f"cpu_bytes ({self.cpu_bytes}) and cpu_slots ({self.cpu_slots}) are exclusive; "
                "set one"
            )
        return self


class RaykvConfig(_Strict):
    """The whole configuration file."""

    offload: OffloadConfig = OffloadConfig()


def _format_errors(exc: ValidationError, source: str) -> ConfigError:
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        got = err.get("input")
        lines.append(f"{path}: {msg}" if isinstance(got, dict) else f"{path}: {msg} (got {got!r})")
    head = f"invalid configuration{f' in {source}' if source else ''}"
    return ConfigError(head + ":\n  " + "\n  ".join(lines))


def _set_path(tree: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    if not all(parts):
        raise ConfigError(f"--set {path}: empty key in path")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"--set {path}: {where} is a value, not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(tree: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides; values are read as YAML scalars (safe loader)."""
    for item in overrides:
        path, sep, raw = item.partition("=")
        if not sep or not path.strip():
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: value is not valid YAML ({exc})") from None
        _set_path(tree, path.strip(), value)
    return tree


def load_config(
    source: str | Path | Mapping[str, Any] | None = None, overrides: Sequence[str] = ()
) -> RaykvConfig:
    """Read a YAML file (or a mapping), apply overrides, validate. Raises ConfigError."""
    name = ""
    if source is None:
        tree: Any = {}
    elif isinstance(source, Mapping):
        tree = dict(source)
    else:
        name = str(source)
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{name}: cannot read config ({exc.strerror})") from None
        try:
            tree = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark else name
            raise ConfigError(f"{where}: malformed YAML ({getattr(exc, 'problem', exc)})") from None
        if tree is None:
            tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{name or 'config'}: top level must be a mapping of sections")
    tree = apply_overrides(_deep_copy(tree), overrides)
    try:
        return RaykvConfig.model_validate(tree)
    except ValidationError as exc:
        raise _format_errors(exc, name) from None


def _deep_copy(tree: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in tree.items()}
