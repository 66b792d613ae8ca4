"""The YAML configuration: pydantic models with strict validation.

Unknown keys are errors, and every error names the offending key path and the value found there,
e.g. ``offload.cpu_bytes: not a size ... (got '2XB')``. Sizes accept plain integers (bytes) or a
number with a unit: ``512KiB``, ``2GiB``, ``1.5GB``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

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

from raykv.faults import parse_fault

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

    enabled: bool = Field(
        default=True, description="Use the CPU tier at all (--no-offload sets it false)."
    )
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
    events: bool = Field(
        default=True,
        description="Emit BlockStored/BlockRemoved KV events (GPU prefix cache and CPU tier).",
    )
    shared_pool: bool = Field(
        default=True,
        description="Keep each rank's CPU-pool shard in shared memory (a file in "
        "shared_pool_dir), so a rank that dies and is replaced finds the CPU tier intact; off: "
        "a rank's death empties the tier.",
    )
    shared_pool_dir: str = Field(
        default="/dev/shm",
        min_length=1,
        description="A tmpfs directory for the shared CPU-pool shards (on every node of ranks).",
    )
    copy_thread: bool | None = Field(
        default=None,
        description="CPU ranks copy in a thread of their own, beside the model (None: yes, "
        "except with a real model, whose compute threads would lose their cores to it: then "
        "the copies run at the step's transfer points, between the model's computations).",
    )
    verify: bool = Field(
        default=False,
        description="Check what every load brings back from the CPU tier: each pool row it "
        "reads must still have the CRC-32 its store recorded, or the load fails as corrupt "
        "(CPU and CUDA ranks alike; computed on the host, which costs a pass over every stored "
        "and loaded page); with the synthetic model each loaded block is also compared with "
        "what recomputing it gives.",
    )
    load_in_step: bool | None = Field(
        default=None,
        description="A request whose prefix comes from the CPU tier computes the rest in the "
        "step that loads it (each rank finishes the load before its model runs) instead of in "
        "the step after every rank acked the load. None: yes where the ranks copy at the step's "
        "transfer points (a real model on CPU ranks), where the load takes its time from that "
        "step anyway; no where copies overlap the model (a copy thread, CUDA streams), where "
        "waiting would stall the whole batch for one request's load.",
    )

    @field_validator("policy")
    @classmethod
    def _policy_spec(cls, value: str) -> str:
        if not _POLICY_RE.match(value):
            raise ValueError("neither a policy name nor a module:Class import path")
        # checked now, not when the CPU tier is built (in a Ray actor, after deployment). The
        # import is deferred: the policies package is plain Python, but config is the top layer.
        from raykv.offload.policies import resolve_policy

        try:
            resolve_policy(value)
        except ValueError:
            raise
        except Exception as exc:  # a custom policy's module failed while importing
            raise ValueError(f"cannot load policy {value!r}: {type(exc).__name__}: {exc}") from None
        return value

    @model_validator(mode="after")
    def _one_size(self) -> OffloadConfig:
        if self.cpu_bytes is not None and self.cpu_slots is not None:
            raise ValueError(
                f"cpu_bytes ({self.cpu_bytes}) and cpu_slots ({self.cpu_slots}) are exclusive; "
                "set one"
            )
        return self


class ModelConfig(_Strict):
    """The model whose KV is cached: the synthetic one (no ``path``), or a real checkpoint."""

    path: str | None = Field(
        default=None,
        description="A real model: a preset (smollm2-135m-instruct), a Hugging Face directory "
        "or a .gguf file; its checkpoint then sets the layers, KV heads, head size, vocabulary "
        "and KV groups.",
    )
    kv_layers_per_group: int | None = Field(
        default=None, gt=0, description="Layers a KV page holds (set from the checkpoint)."
    )
    max_positions: int | None = Field(
        default=None,
        gt=0,
        description="Prompt plus output tokens one request may hold (a real model: its context "
        "from the checkpoint, or less where set lower; a larger value is refused with a warning "
        "and the checkpoint's kept; None: no limit but the GPU pool's).",
    )
    stop_token_ids: list[int] = Field(
        default_factory=list,
        description="Tokens that end a request (a real model: its EOS tokens are added from "
        "the checkpoint).",
    )
    weights_cache_dir: str = Field(
        default_factory=lambda: os.environ.get(
            "RAYKV_WEIGHTS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "raykv")
        ),
        description="Where a GGUF checkpoint's dequantized weights (safetensors, with its "
        "config) and its converted tokenizer are kept, so that a second start skips the "
        "dequantization and the conversion ('' turns the cache off).",
    )

    @property
    def cache_dir(self) -> str | None:
        """``weights_cache_dir``, None where it is off ('')."""
        return self.weights_cache_dir or None

    num_layers: int = Field(
        default=4,
        gt=0,
        description="Layers, split evenly over the KV groups (a checkpoint's go by attention "
        "kind; set from the checkpoint).",
    )
    num_kv_heads: int = Field(default=4, gt=0, description="KV heads in total, split over ranks.")
    head_dim: int = Field(
        default=32, gt=0, description="Size of one head (set from the checkpoint)."
    )
    dtype: Literal["float16", "bfloat16", "float32"] = Field(
        default="float16", description="The KV cache's (and a real model's) element type."
    )
    vocab_size: int = Field(
        default=32000,
        ge=16,
        description="The vocabulary: token ids a prompt may hold (the synthetic sampler's top "
        "id is EOS; set from the checkpoint).",
    )
    eos_every: int = Field(
        default=0, ge=0, description="EOS is sampled about once per this many tokens (0: never)."
    )


class GroupConfig(_Strict):
    """One KV-cache group: layers sharing an attention pattern."""

    kind: Literal["full_attention", "sliding_window"] = Field(
        default="full_attention", description="The attention pattern of the group's layers."
    )
    window_tokens: int | None = Field(
        default=None,
        gt=0,
        description="A sliding window's length in tokens, the current one included (only for "
        "sliding_window).",
    )

    @model_validator(mode="after")
    def _window(self) -> GroupConfig:
        if self.kind == "sliding_window" and self.window_tokens is None:
            raise ValueError("a sliding_window group needs window_tokens")
        if self.kind == "full_attention" and self.window_tokens is not None:
            raise ValueError("window_tokens applies only to sliding_window groups")
        return self


class CacheConfig(_Strict):
    """The paged GPU KV cache."""

    block_size: int = Field(default=16, gt=0, description="Tokens per GPU block.")
    num_gpu_blocks: int = Field(default=192, ge=2, description="Blocks per rank (block 0 is null).")
    groups: list[GroupConfig] = Field(default_factory=lambda: [GroupConfig()], min_length=1)


class ParallelConfig(_Strict):
    tensor_parallel_size: int = Field(
        default=1,
        gt=0,
        description="Ranks (each holds num_kv_heads / tp heads of every block).",
    )
    device: Literal["cpu", "cuda"] = Field(
        default="cpu",
        description="cpu (the CPU transfer engine) or cuda (CUDA streams, events, a pinned "
        "pool; one GPU per rank on Ray).",
    )
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        default="STRICT_PACK", description="Ray placement group strategy for the rank workers."
    )
    step_timeout_s: float = Field(
        default=120.0, gt=0, description="A rank that does not answer a step this long is dead."
    )
    control_plane: Literal["auto", "graph", "calls"] = Field(
        default="auto",
        description="How the scheduler actor reaches the rank actors each step. graph: one "
        "execution of a Ray Compiled Graph (shared-memory channels, whose readers spin: a core "
        "each while they wait); calls: one Ray actor call per rank (also the fallback where a "
        "graph cannot be compiled); auto: graph for cuda ranks, calls for cpu ranks, whose "
        "model the spinning would slow down.",
    )
    collective_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="A real model's tensor-parallel collective (all-reduce) waits at most this "
        "long for the other ranks; then the rank leaves and its TP group is restarted.",
    )
    cpu_threads_per_rank: int | None = Field(
        default=None,
        gt=0,
        description="torch threads of each CPU rank (default: the node's cores shared among "
        "the ranks, at least 1).",
    )


SchedulePolicy = Literal["fcfs", "shortest-prefill"]  # the engine scheduler's admission orders


class EngineConfig(_Strict):
    max_num_seqs: int = Field(default=32, gt=0, description="Requests running or loading at once.")
    max_num_batched_tokens: int = Field(
        default=2048,
        gt=0,
        description="Tokens computed per step (longer prompts prefill in chunks).",
    )
    schedule_policy: SchedulePolicy = Field(
        default="fcfs",
        description="Order of admission. fcfs: arrival order. shortest-prefill: the waiting "
        "request with the fewest prompt tokens left to compute after the GPU prefix cache and "
        "the CPU tier first (ties by arrival), bounded by max_bypass_steps.",
    )
    max_bypass_steps: int = Field(
        default=16,
        gt=0,
        description="shortest-prefill: steps a request may be passed over before it is admitted "
        "first, in arrival order.",
    )
    short_prefill_alone: int = Field(
        default=0,
        ge=0,
        description="A step whose prompt work gives a first token and computes at most this many "
        "tokens (a prompt the caches served) runs without the decodes, which go next step; "
        "never two steps in a row, never while requests are left waiting (0: never).",
    )
    async_scheduling: bool = Field(
        default=False,
        description="Plan each step while the ranks run the one before (its decodes' input "
        "tokens written in once that one answers); acks count a step later.",
    )
    max_deferred_steps: int = Field(
        default=64,
        ge=0,
        description="Steps a request may wait, in all, for chunks still being written (or "
        "loaded by another request) before it recomputes instead. Its own transfers in flight "
        "always make it wait: they end by themselves (acked, asked again, or failed with a "
        "rank declared dead).",
    )
    ack_timeout_steps: int = Field(
        default=32,
        gt=0,
        description="Steps a job may go unacked before its ranks are asked to finish and "
        "report it again.",
    )
    rank_timeout_steps: int = Field(
        default=256,
        gt=0,
        description="Steps a job may go unacked in all before the silent ranks count as dead.",
    )
    keep_finished: bool = Field(
        default=True,
        description="Keep finished requests' state (for reports and CPU-tier checks); off for "
        "long-running serving, where only their outputs are kept (and only the latest "
        "requests' first-token records and refusals).",
    )
    latency_samples: int = Field(
        default=65536,
        gt=0,
        description="TTFT and ITL values kept for the percentiles: all of them up to this "
        "many, then a uniform sample of this many (the mean stays exact), so a server's "
        "memory stays flat however long it runs.",
    )


class WorkloadConfig(_Strict):
    """What ``raykv run`` replays."""

    kind: Literal["synthetic", "trace", "chat"] = Field(
        default="synthetic",
        description="synthetic: token-id conversations; trace: a Mooncake trace; chat: a real "
        "model's conversations in text, each answer fed into the next turn (needs model.path).",
    )
    trace: str | None = Field(default=None, description="Mooncake JSONL file (kind: trace).")
    chat_turns: int = Field(default=4, gt=0, description="Questions per conversation (chat).")
    num_requests: int = Field(default=200, gt=0, description="Requests to run (--num-requests).")
    seed: int = Field(
        default=0, description="Seeds the synthetic generator and the trace's token ids."
    )
    arrival_rate: float | None = Field(
        default=None,
        ge=0,
        description="Requests arriving per engine step (0: all at once). None: 2 for the "
        "synthetic workload; a trace at half the rate the engine serves (its seats, token "
        "budget and GPU pool), its own timestamps setting the gaps.",
    )
    max_tokens: int = Field(default=24, gt=0, description="Tokens generated per request.")
    system_prompts: int = Field(
        default=6, gt=0, description="Shared system prompts (picked with a skew to the first)."
    )
    system_prompt_tokens: int = Field(
        default=192, gt=0, description="Mean system prompt length in tokens."
    )
    user_tokens: int = Field(default=48, gt=0, description="Mean new user tokens per turn.")
    answer_tokens: int = Field(default=32, gt=0, description="Answer tokens kept in history.")
    mean_turns: float = Field(default=4.0, ge=1, description="Mean turns per conversation.")
    concurrent_conversations: int = Field(
        default=16,
        gt=0,
        description="Conversations open at once, taking turns at random.",
    )
    trace_time_scale: float | None = Field(
        default=None,
        gt=0,
        description="Replay a trace at its own timestamps on the wall clock: seconds times "
        "this factor (2: half the recorded rate); None: on the engine-step clock (arrival_rate).",
    )
    trace_tokens_per_block: int = Field(
        default=512, gt=0, description="Tokens per trace hash id (512 in Mooncake traces)."
    )

    @model_validator(mode="after")
    def _trace(self) -> WorkloadConfig:
        if self.kind == "trace" and not self.trace:
            raise ValueError("kind: trace needs a trace file (workload.trace)")
        return self


class RouterWeightsConfig(_Strict):
    """The KV-aware router's cost of sending a request to a replica, in prompt tokens to
    compute: ``computed + cpu_hit_cost * loaded_from_cpu + spilled_queue + decode_cost *
    decoding`` (a GPU hit costs nothing; ``spilled_queue`` is the queued prefill that does not
    fit in the replica's next step beside the prompt); docs/serving.md ("The KV-aware router")
    says how each was measured."""

    cpu_hit_cost: float = Field(
        default=0.02, ge=0, description="A prompt token loaded from the CPU tier, in computed ones."
    )
    decode_cost: float = Field(
        default=4.0, ge=0, description="A request decoding on the replica, in computed tokens."
    )
    imbalance: float = Field(
        default=2.0,
        ge=1,
        description="Power of two choices instead when the cheapest replica's queue is this "
        "many times the least busy one's",
    )
    imbalance_tokens: int = Field(
        default=2048, ge=0, description="... and longer than it by this many tokens."
    )


class ServeConfig(_Strict):
    """``raykv serve``: where to listen, how many replicas, how requests pick one. The API key
    is never read from a file: ``--api-key`` or RAYKV_API_KEY."""

    host: str = Field(default="127.0.0.1", description="Where to listen (loopback by default).")
    port: int = Field(default=8000, gt=0, lt=65536, description="Where to listen.")
    replicas: int = Field(default=1, gt=0, description="Engine replicas.")
    replica_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom resources each replica asks for beside its CPU (e.g. a node "
        "type's, or a one-per-node slot to spread replicas over nodes).",
    )
    router: Literal["kv", "pow2", "prefix"] | None = Field(
        default=None, description="None: kv with more than one replica, else pow2."
    )
    insecure: bool = Field(default=False, description="Allow a non-loopback host without a key.")
    router_weights: RouterWeightsConfig = RouterWeightsConfig()
    max_request_bytes: ByteSize = Field(
        default=4 * 2**20,
        gt=0,
        description="The largest request body the server reads (a bigger one is refused with "
        "413 before it is parsed): 4 MiB holds a 128k-token prompt as text or as token ids "
        "(parsing holds the interpreter for about 20 ms per MiB of token ids).",
    )


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
        if self.offload.enabled and self.offload.cpu_bytes is not None:
            chunk = self.chunk_bytes_total()
            if self.offload.cpu_bytes < chunk:
                raise ValueError(
                    f"offload.cpu_bytes ({self.offload.cpu_bytes}) is smaller than one chunk "
                    f"({chunk} bytes across {tp} ranks)"
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
            return max(1, o.cpu_bytes // self.chunk_bytes_total())
        return max(1, 4 * self.cache.num_gpu_blocks // o.blocks_per_chunk)


def _format_errors(exc: ValidationError, source: str) -> ConfigError:
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        got = err.get("input")
        line = f"{path}: {msg}" if path else msg  # cross-field checks name their own keys
        lines.append(line if isinstance(got, dict) else f"{line} (got {got!r})")
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
