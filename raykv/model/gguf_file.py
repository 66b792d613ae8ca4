"""GGUF checkpoints (llama.cpp's format), read with the ``gguf`` library.

Quantized tensors (Q8_0, Q4_0, Q4_1, ...) are dequantized at load; F32, F16 and BF16 are taken
as they are. Tensor names are mapped to the Hugging Face names the decoder uses, and the query
and key projections are put back in Hugging Face's head order: llama.cpp's converter interleaves
the two rotary halves of every head, which this loader undoes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from raykv.model.checkpoint import gguf_config, read_gguf
from raykv.model.spec import ModelSpec, UnsupportedModel

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# llama.cpp's converter stores Llama 3's RoPE scaling as one divisor per rotary dimension pair
# (``rope_freqs.weight``) instead of metadata: the decoder divides its frequencies by them
ROPE_FREQ_FACTORS = "rope_freqs.weight"


def _hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name == "rope_freqs.weight":  # llama3 scaling, precomputed: see ROPE_FREQ_FACTORS
        return ROPE_FREQ_FACTORS
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise UnsupportedModel(f"GGUF tensor {name!r} has no place in the decoder")


def unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary reordering of a q or k projection (``[heads * head_dim, ...]``):
    within each head it stores the two halves' dimensions interleaved."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def load_gguf(path: str | Path) -> tuple[ModelSpec, dict[str, torch.Tensor], dict[str, Any]]:
    """The model's description, its tensors by Hugging Face name (float32), and the config
    it was read from (``config.json``'s keys)."""
    from gguf.quants import dequantize

    file = Path(path)
    if not file.is_file():
        raise UnsupportedModel(f"{file}: no such GGUF file")
    reader = read_gguf(file)
    config = gguf_config(reader, file)
    spec = ModelSpec.from_hf_config(config, file)
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:  # a type gguf cannot dequantize
            raise UnsupportedModel(
                f"{file}: tensor {tensor.name!r} of type {tensor.tensor_type.name} cannot be "
                f"read ({exc})"
            ) from None
        shape = tuple(int(n) for n in reversed(tensor.shape))
        array = np.array(values, dtype=np.float32, copy=True).reshape(shape)  # writable
        weights[_hf_name(tensor.name)] = torch.from_numpy(array)
    for i in range(spec.num_layers):
        for name, heads in (("q_proj", spec.num_heads), ("k_proj", spec.num_kv_heads)):
            key = f"model.layers.{i}.self_attn.{name}.weight"
            if spec.model_type == "llama" and key in weights:
                weights[key] = unpermute_rotary(weights[key], heads)
    return spec, weights, config
