"""What a checkpoint's ``config.json`` says about the model, in the terms the decoder needs.

Llama, Mistral, Qwen2 and Qwen3 share one decoder; their differences are fields here (q/k/v
bias, q/k RMSNorm, an explicit head size, sliding-window layers, RoPE scaling). Anything else is
refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelSpec:
        """Read a Hugging Face ``config.json`` (already parsed)."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED:
            raise UnsupportedModel(
                f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED)})"
            )
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=_rope(config),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            windows=_windows(config, layers),
            max_positions=int(config.get("max_position_embeddings", 2048)),
            eos_token_ids=eos_ids,
        )


def _rope(config: dict[str, Any]) -> RopeSpec:
    # transformers 5 writes one ``rope_parameters`` dict; older files ``rope_theta`` and
    # ``rope_scaling``
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        raise UnsupportedModel(f"rope scaling {kind!r} is not supported (default, linear, llama3)")
    return RopeSpec(
        theta=theta,
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
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if types is not None:
        if len(types) != layers:
            raise UnsupportedModel(f"layer_types lists {len(types)} layers, the model has {layers}")
        bad = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
        if bad:
            raise UnsupportedModel(f"layer type {bad[0]!r} is not supported")
        if "sliding_attention" in types and not window:
            raise UnsupportedModel("sliding_attention layers without a sliding_window")
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    model_type = config.get("model_type")
    if model_type == "mistral" and window:
        return (int(window),) * layers
    if model_type in ("qwen2", "qwen3") and config.get("use_sliding_window") and window:
        first = int(config.get("max_window_layers", layers))
        return tuple(int(window) if i >= first else None for i in range(layers))
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
