"""What a checkpoint's ``config.json`` says about the model, in the terms the decoder needs.

Llama, Mistral, Qwen2 and Qwen3 share one decoder; their differences are fields here (q/k/v
bias, q/k RMSNorm, an explicit head size, sliding-window layers, RoPE scaling). Anything else is
refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from raykv.error_text import shown

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModel(ValueError):
    """A checkpoint this decoder cannot run; the message names what is at fault."""


@dataclass(frozen=True, slots=True)
class RopeSpec:
    theta: float
    kind: str = "default"  # "default", "linear" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope: RopeSpec
    tie_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    # per layer: None for full attention, else the window in tokens (counting the current one)
    windows: tuple[int | None, ...] = field(default_factory=tuple)
    max_positions: int = 2048
    eos_token_ids: tuple[int, ...] = ()

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Refuse a TP size that cannot split this model, naming the counts."""
        for what, count in (
            ("query heads", self.num_heads),
            ("KV heads", self.num_kv_heads),
            ("MLP width", self.intermediate_size),
        ):
            if count % tp_size:
                raise UnsupportedModel(
                    f"parallel.tensor_parallel_size {tp_size} does not divide the model's "
                    f"{count} {what}"
                )

    def required_tensors(self) -> list[str]:
        """The names of the tensors the decoder reads from a checkpoint of this model (Hugging
        Face's names; a GGUF file's are mapped to them), in the order it reads them."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.tie_embeddings:
            names.append("lm_head.weight")
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
            if self.qk_norm:
                names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
            projections = ("q_proj", "k_proj", "v_proj")
            names += [f"{p}self_attn.{n}.weight" for n in projections]
            if self.qkv_bias:
                names += [f"{p}self_attn.{n}.bias" for n in projections]
            names += [f"{p}mlp.{n}.weight" for n in ("gate_proj", "up_proj")]
            names += [f"{p}self_attn.o_proj.weight", f"{p}mlp.down_proj.weight"]
        return names

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], source: object = None) -> ModelSpec:
        """Read a Hugging Face ``config.json`` (already parsed). Every field it uses is checked
        for its kind and range; ``source`` (the file it came from) starts any error."""
        try:
            return cls._from_checked_config(config)
        except UnsupportedModel as exc:
            if source is None:
                raise
            raise UnsupportedModel(f"{source}: {exc}") from None

    @classmethod
    def _from_checked_config(cls, config: dict[str, Any]) -> ModelSpec:
        if not isinstance(config, dict):
            raise UnsupportedModel(f"expected a JSON object, got {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            raise UnsupportedModel(f"field 'model_type' must be a string, got {shown(model_type)}")
        if model_type not in SUPPORTED:
            raise UnsupportedModel(
                f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED)})"
            )
        hidden = _integer(config, "hidden_size")
        heads = _integer(config, "num_attention_heads")
        layers = _integer(config, "num_hidden_layers")
        head_dim = _integer(config, "head_dim", None)
        if head_dim is None:
            if hidden % heads:
                raise UnsupportedModel(
                    f"field 'hidden_size' {hidden} is not a multiple of num_attention_heads "
                    f"{heads}, and there is no head_dim"
                )
            head_dim = hidden // heads
        kv_heads = _integer(config, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise UnsupportedModel(
                f"field 'num_key_value_heads' {kv_heads} does not divide num_attention_heads "
                f"{heads}"
            )
        return cls(
            model_type=model_type,
            vocab_size=_integer(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_integer(config, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_eps=_positive_number(config, "rms_norm_eps", 1e-6),
            rope=_rope(config),
            tie_embeddings=_flag(config, "tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or _flag(config, "attention_bias", False),
            qk_norm=model_type == "qwen3",
            windows=_windows(config, layers),
            max_positions=_integer(config, "max_position_embeddings", 2048),
            eos_token_ids=eos_token_ids(config.get("eos_token_id")),
        )


_REQUIRED: Any = object()

# no count or size of a model reaches 2**31; past it torch's sizes overflow, so a number that
# big is a broken file's
MAX_SIZE = 2**31 - 1


def _is_integer(value: object) -> bool:
    # a bool is an int to Python, never to a config; 64.0 is no int either (transformers
    # refuses it too)
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(
    config: dict[str, Any],
    name: str,
    default: Any = _REQUIRED,
    minimum: int = 1,
    where: str = "",
) -> Any:
    """``config[name]``, an integer >= ``minimum``; ``default`` where it is missing or null
    (``where`` says whose field it is, for a nested one)."""
    value = config.get(name)
    if value is None:
        if default is _REQUIRED:
            raise UnsupportedModel(f"missing field {name!r}{where}")
        return default
    if not _is_integer(value) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise UnsupportedModel(f"field {name!r}{where} must be {kind}, got {shown(value)}")
    if value > MAX_SIZE:
        raise UnsupportedModel(f"field {name!r}{where} must be <= {MAX_SIZE}, got {shown(value)}")
    return value


def _positive_number(config: dict[str, Any], name: str, default: float, where: str = "") -> float:
    """``config[name]``, a finite number > 0; ``default`` where it is missing or null."""
    value = config.get(name)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise UnsupportedModel(
            f"field {name!r}{where} must be a finite number > 0, got {shown(value)}"
        )
    return float(value)


def _flag(config: dict[str, Any], name: str, default: bool) -> bool:
    value = config.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):  # bool("false") would be True
        raise UnsupportedModel(f"field {name!r} must be true or false, got {shown(value)}")
    return value


def eos_token_ids(value: object) -> tuple[int, ...]:
    """An ``eos_token_id`` field's tokens: none (null), one id or a list of ids."""
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(_is_integer(t) and t >= 0 for t in ids):
        raise UnsupportedModel(
            f"field 'eos_token_id' must be a token id (an integer >= 0) or a list of them, "
            f"got {shown(value)}"
        )
    return tuple(ids)


def _rope_section(config: dict[str, Any], name: str) -> dict[str, Any]:
    """``rope_parameters`` or ``rope_scaling``, checked: an object (or null) of numbers."""
    value = config.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UnsupportedModel(f"field {name!r} must be an object, got {shown(value)}")
    where = f" of {name}"
    for key in ("rope_type", "type"):
        if value.get(key) is not None and not isinstance(value[key], str):
            raise UnsupportedModel(
                f"field {key!r}{where} must be a string, got {shown(value[key])}"
            )
    for key in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor"):
        _positive_number(value, key, 1.0, where)
    _integer(value, "original_max_position_embeddings", None, where=where)
    return value


def _rope(config: dict[str, Any]) -> RopeSpec:
    # transformers 5 writes one ``rope_parameters`` dict; older files ``rope_theta`` and
    # ``rope_scaling``
    params = _rope_section(config, "rope_parameters")
    scaling = _rope_section(config, "rope_scaling")
    theta = params.get("rope_theta") or _positive_number(config, "rope_theta", 10000.0)
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        raise UnsupportedModel(f"rope scaling {kind!r} is not supported (default, linear, llama3)")
    return RopeSpec(
        theta=float(theta),
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_positions=int(merged.get("original_max_position_embeddings", 8192)),
    )


def _windows(config: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers decides it: an
    explicit ``layer_types`` list, else Mistral's ``sliding_window`` on every layer, else
    Qwen2/3's ``use_sliding_window`` from layer ``max_window_layers`` on."""
    window = _integer(config, "sliding_window", None, minimum=0)  # 0: none, as null
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list):
            raise UnsupportedModel(f"field 'layer_types' must be a list, got {shown(types)}")
        if len(types) != layers:
            raise UnsupportedModel(f"layer_types lists {len(types)} layers, the model has {layers}")
        for index, kind in enumerate(types):
            if kind not in ("full_attention", "sliding_attention"):
                raise UnsupportedModel(
                    f"field 'layer_types': layer type {shown(kind)} (layer {index}) is not "
                    "supported (full_attention, sliding_attention)"
                )
        if "sliding_attention" in types and not window:
            raise UnsupportedModel("sliding_attention layers without a sliding_window")
        return tuple(window if t == "sliding_attention" else None for t in types)
    model_type = config.get("model_type")
    if model_type == "mistral" and window:
        return (window,) * layers
    if model_type in ("qwen2", "qwen3") and _flag(config, "use_sliding_window", False) and window:
        first = _integer(config, "max_window_layers", layers, minimum=0)
        return tuple(window if i >= first else None for i in range(layers))
    return (None,) * layers


@dataclass(frozen=True, slots=True)
class KVPlacement:
    """Where each layer's KV lives: its KV group and its index among that group's layers."""

    group_of: tuple[int, ...]
    index_in_group: tuple[int, ...]
    layers_per_group: int  # the page holds this many layers (a group may use fewer)

    @classmethod
    def for_windows(cls, windows: Sequence[int | None]) -> tuple[KVPlacement, list[int | None]]:
        """Layers grouped by attention kind (full, then each window size, in order of first
        appearance); returns the placement and each group's window."""
        kinds: list[int | None] = []
        for w in windows:
            if w not in kinds:
                kinds.append(w)
        group_of, index, counts = [], [], [0] * len(kinds)
        for w in windows:
            g = kinds.index(w)
            group_of.append(g)
            index.append(counts[g])
            counts[g] += 1
        return cls(tuple(group_of), tuple(index), max(counts)), kinds
