"""The whole config (``RaykvConfig``: its sections and the checks across them) and where it
comes from: a YAML file, the built-in defaults, ``--set KEY.PATH=VALUE`` overrides."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from raykv.config.base import ConfigError, _Strict, whole_chunks
from raykv.config.sections import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    OffloadConfig,
    ParallelConfig,
    ServeConfig,
    WorkloadConfig,
)
from raykv.faults import parse_fault


class RaykvConfig(_Strict):
    """The whole configuration file."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    offload: OffloadConfig = OffloadConfig()
    parallel: ParallelConfig = ParallelConfig()
    engine: EngineConfig = EngineConfig()
    workload: WorkloadConfig = WorkloadConfig()
    serve: ServeConfig = ServeConfig()
    faults: list[str] = Field(
        default_factory=list, description="Fault injection specs (see raykv/faults.py)."
    )

    @field_validator("faults")
    @classmethod
    def _faults(cls, value: list[str]) -> list[str]:
        for spec in value:
            parse_fault(spec)  # raises with the spec quoted
        return value

    @model_validator(mode="after")
    def _consistent(self) -> RaykvConfig:
        tp = self.parallel.tensor_parallel_size
        # a checkpoint's own head counts are checked against the TP size when it is read
        if self.model.path is None and self.model.num_kv_heads % tp:
            raise ValueError(
                f"parallel.tensor_parallel_size ({tp}) must divide model.num_kv_heads "
                f"({self.model.num_kv_heads})"
            )
        for spec in self.faults:
            rank = parse_fault(spec).rank
            if rank is not None and rank >= tp:
                raise ValueError(
                    f"faults: fault {spec!r}: rank {rank} does not exist with "
                    f"parallel.tensor_parallel_size {tp} (ranks 0-{tp - 1})"
                )
        groups = len(self.cache.groups)
        # a real checkpoint's layers go to groups by attention kind, unevenly if need be
        # (model.kv_layers_per_group, set by configure): pages hold the largest group's layers
        if self.model.kv_layers_per_group is None and self.model.num_layers % groups:
            raise ValueError(
                f"model.num_layers ({self.model.num_layers}) must split evenly over the "
                f"{groups} cache.groups"
            )
        for i, g in enumerate(self.cache.groups):
            if g.window_tokens is not None and g.window_tokens < 2:
                raise ValueError(f"cache.groups.{i}.window_tokens must be at least 2")
        # a real model's chunk is known once its checkpoint is read (``cpu_slots`` checks it)
        if self.offload.enabled and self.offload.cpu_bytes is not None and not self.model.path:
            chunk = self.chunk_bytes_total()
            if self.offload.cpu_bytes < chunk:
                raise ValueError(
                    f"offload.cpu_bytes ({self.offload.cpu_bytes}) is smaller than one chunk "
                    f"({chunk} bytes across {tp} ranks)"
                )
        shared = self.offload.shared
        if self.offload.enabled and shared.enabled:
            # a part is a header (4 KiB) and its pages, on every rank
            part = self.chunk_bytes_total() + 4096 * tp
            if shared.segment < part:
                raise ValueError(
                    f"offload.shared.segment ({shared.segment}) is smaller than one chunk in "
                    f"the store ({part} bytes across {tp} ranks)"
                )
        return self

    # ---- derived sizes (plain arithmetic, shared by every layer) ----

    def copy_thread(self) -> bool:
        """Whether CPU ranks copy in a thread (``offload.copy_thread``, resolved)."""
        if self.offload.copy_thread is not None:
            return self.offload.copy_thread
        return not (self.model.path is not None and self.parallel.device == "cpu")

    def load_in_step(self) -> bool:
        """Whether a loaded request computes in its load's step (``offload.load_in_step``,
        resolved)."""
        if self.offload.load_in_step is not None:
            return self.offload.load_in_step
        return self.parallel.device == "cpu" and not self.copy_thread()

    @property
    def layers_per_group(self) -> int:
        if self.model.kv_layers_per_group is not None:
            return self.model.kv_layers_per_group
        return self.model.num_layers // len(self.cache.groups)

    @property
    def kv_heads_per_rank(self) -> int:
        return self.model.num_kv_heads // self.parallel.tensor_parallel_size

    @property
    def dtype_bytes(self) -> int:
        return {"float16": 2, "bfloat16": 2, "float32": 4}[self.model.dtype]

    def page_bytes(self) -> int:
        """Bytes of one block of one KV group on one rank (all of that group's layers)."""
        m, c = self.model, self.cache
        return (
            self.layers_per_group
            * 2
            * self.kv_heads_per_rank
            * c.block_size
            * m.head_dim
            * (self.dtype_bytes)
        )

    def chunk_bytes_total(self) -> int:
        """Bytes one CPU slot holds across all ranks."""
        return (
            self.page_bytes() * self.offload.blocks_per_chunk * self.parallel.tensor_parallel_size
        )

    def cpu_slots(self) -> int:
        """CPU slots: ``cpu_slots``, or ``cpu_bytes`` divided by a chunk's bytes on all ranks,
        or by default four times the GPU blocks' worth."""
        o = self.offload
        if o.cpu_slots is not None:
            return o.cpu_slots
        if o.cpu_bytes is not None:
            # checked again here: a real model's geometry comes from its checkpoint, after
            # the config was read (a chunk of SmolLM2 is 720 KiB)
            return whole_chunks(
                o.cpu_bytes,
                self.chunk_bytes_total(),
                "offload.cpu_bytes",
                "one chunk of the model",
                f"{self.parallel.tensor_parallel_size} ranks",
            )
        return max(1, 4 * self.cache.num_gpu_blocks // o.blocks_per_chunk)


def error_lines(exc: ValidationError, prefix: str = "") -> list[str]:
    """One line per mistake, each naming its key path (after ``prefix``) and the value given."""
    lines = []
    for err in exc.errors():
        path = prefix + ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        got = err.get("input")
        path = path.rstrip(".")
        line = f"{path}: {msg}" if path else msg  # cross-field checks name their own keys
        lines.append(line if isinstance(got, dict) else f"{line} (got {got!r})")
    return lines


def _format_errors(exc: ValidationError, source: str) -> ConfigError:
    lines = error_lines(exc)
    head = f"invalid configuration{f' in {source}' if source else ''}"
    if len(lines) == 1:  # one mistake, one line
        return ConfigError(f"{head}: {lines[0]}")
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


def _has_path(tree: Mapping[str, Any], path: str) -> bool:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return node is not None


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
    source: str | Path | Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    defaults: Sequence[str] = (),
) -> RaykvConfig:
    """Read a YAML file (or a mapping), apply overrides, validate. Raises ConfigError.
    ``defaults`` (``key.path=value`` too) apply only where neither the file nor the overrides
    set the key: a command's own defaults (``raykv generate``'s model and dtype)."""
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
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start + 1})"
            ) from None
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
    unset = [item for item in defaults if not _has_path(tree, item.partition("=")[0].strip())]
    tree = apply_overrides(tree, unset)
    try:
        return RaykvConfig.model_validate(tree)
    except ValidationError as exc:
        raise _format_errors(exc, name) from None


def _deep_copy(tree: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in tree.items()}
