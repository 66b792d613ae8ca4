"""Where a checkpoint is and what it is, without loading its weights (no torch): a preset name,
a Hugging Face directory or a GGUF file, and the config that serves it.

``configure`` sets the config's model and KV-cache geometry from the checkpoint: layers, KV
heads, head size, vocabulary, and the KV groups (one per attention kind: full attention and each
sliding window), so the pages the ranks allocate are the pages the model reads and writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from raykv.config import GroupConfig, RaykvConfig
from raykv.model.presets import PRESETS, preset_path
from raykv.model.spec import KVPlacement, ModelSpec, UnsupportedModel

_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def resolve(path: str) -> Path:
    """A preset's file, or the given directory or ``.gguf`` file (which must exist)."""
    if path in PRESETS:
        return preset_path(path)
    file = Path(path)
    if file.is_dir() or (file.is_file() and file.suffix == ".gguf"):
        return file
    raise UnsupportedModel(
        f"model.path {path!r}: no such model directory or .gguf file "
        f"(presets: {', '.join(PRESETS)})"
    )


def hf_config(path: Path) -> dict[str, Any]:
    """``config.json``'s contents, or the same keys read from a GGUF file's metadata."""
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise UnsupportedModel(f"{path}: no config.json")
        return json.loads(config.read_text())
    from gguf import GGUFReader

    return gguf_config(GGUFReader(str(path)))


def gguf_config(reader: Any) -> dict[str, Any]:
    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported")

    def get(key: str, default: Any = None) -> Any:
        return field(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens.data) if tokens is not None else None)
    hidden = int(get("embedding_length"))
    config: dict[str, Any] = {
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length") or hidden // heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):  # linear is what Llama files use; others are refused
        config["rope_scaling"] = {
            "rope_type": str(scaling),
            "factor": float(get("rope.scaling.factor", 1.0)),
        }
    eos = field("tokenizer.ggml.eos_token_id")
    if eos is not None:
        config["eos_token_id"] = int(eos)
    return config


def configure(cfg: RaykvConfig) -> tuple[RaykvConfig, ModelSpec, Path]:
    """``cfg`` with the model's geometry taken from ``cfg.model.path``'s checkpoint."""
    if cfg.model.path is None:
        raise ValueError("configure needs model.path")
    path = resolve(cfg.model.path)
    spec = ModelSpec.from_hf_config(hf_config(path))
    spec.check_tensor_parallel(cfg.parallel.tensor_parallel_size)
    placement, kinds = KVPlacement.for_windows(spec.windows)
    groups = [
        GroupConfig() if w is None else GroupConfig(kind="sliding_window", window_tokens=w)
        for w in kinds
    ]
    model = cfg.model.model_copy(
        update={
            "num_layers": spec.num_layers,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "vocab_size": spec.vocab_size,
            "kv_layers_per_group": placement.layers_per_group,
            "max_positions": spec.max_positions,
            "stop_token_ids": sorted(
                {*cfg.model.stop_token_ids, *spec.eos_token_ids, *_generation_eos(path)}
            ),
        }
    )
    cache = cfg.cache.model_copy(update={"groups": groups})
    return cfg.model_copy(update={"model": model, "cache": cache}), spec, path


def _generation_eos(path: Path) -> list[int]:
    """The EOS tokens of a directory's ``generation_config.json`` (chat models often list
    more there than in ``config.json``)."""
    file = path / "generation_config.json" if path.is_dir() else None
    if file is None or not file.is_file():
        return []
    eos = json.loads(file.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(t) for t in (eos if isinstance(eos, list) else [eos])]


def with_stop_tokens(cfg: RaykvConfig, token_ids: Iterable[int | None]) -> RaykvConfig:
    """``cfg`` with more tokens that end a request (a tokenizer's EOS beside the checkpoint's;
    None is skipped)."""
    stops = sorted({*cfg.model.stop_token_ids, *(t for t in token_ids if t is not None)})
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"stop_token_ids": stops})})
