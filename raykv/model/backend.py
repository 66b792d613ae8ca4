"""A real model as a rank's model: the rank runner hands it each step's batch."""

from __future__ import annotations

from pathlib import Path

import torch

from raykv.core.step import ModelEntry
from raykv.model.decoder import AllReduce, Decoder, SequenceChunk
from raykv.model.sampling import SamplingParams, sample_token
from raykv.model.spec import ModelSpec

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_weights(path: Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """A checkpoint's description and tensors: a Hugging Face directory or a GGUF file."""
    if path.is_dir():
        from raykv.model.weights import load_hf_directory

        return load_hf_directory(path)
    from raykv.model.gguf_file import load_gguf

    spec, weights, _ = load_gguf(path)
    return spec, weights


class LlmModel:
    """One rank's shard of a real model. Every rank samples the same token from the same
    logits (the LM head is replicated), so the reply of any rank is the step's token."""

    def __init__(
        self,
        path: Path,
        block_size: int,
        dtype: str,
        device: str | torch.device = "cpu",
        *,
        rank: int = 0,
        tp_size: int = 1,
        all_reduce: AllReduce | None = None,
    ) -> None:
        spec, weights = load_weights(path)
        self.spec = spec
        self.decoder = Decoder(
            spec,
            weights,
            block_size,
            _DTYPES[dtype],
            device,
            rank=rank,
            tp_size=tp_size,
            all_reduce=all_reduce,
        )
        self.sampling = SamplingParams()  # greedy (per-request parameters come later)

    def step(self, kv: torch.Tensor, batch: list[ModelEntry]) -> list[int]:
        """Compute the batch; the sampled token of each sampling entry (0 for the others)."""
        chunks = [
            SequenceChunk(e.tokens, e.start, e.block_tables, sample=bool(e.read_blocks))
            for e in batch
        ]
        with torch.inference_mode():
            logits = iter(self.decoder.forward(chunks, kv))
        return [
            sample_token(next(logits), self.sampling, e.position).token_id if e.read_blocks else 0
            for e in batch
        ]
