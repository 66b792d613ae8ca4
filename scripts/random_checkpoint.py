"""Writes a randomly initialised Llama checkpoint of SmolLM2-135M's shape (no tokenizer) to a
directory: a real-sized model for timing on a machine that cannot download one, such as the lent
GPU machine (``scripts/gpu_check.sh``). Usage: ``random_checkpoint.py DIR [--dtype bfloat16]
[--layers N]`` (fewer layers: a model of the same width whose steps take as long on a few CPU cores
as the full one's take on a GPU)."""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# SmolLM2-135M-Instruct's config.json, the fields that set the compute and the KV size
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"])
    args = parser.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": args.layers}))
    model.to(getattr(torch, args.dtype)).save_pretrained(args.directory)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"wrote {args.directory}: {millions:.0f}M parameters")


if __name__ == "__main__":
    main()
