"""A real model as a rank's model: the rank runner hands it each step's batch."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from raykv.core.step import SAMPLE_FAILED, ModelEntry, ModelOutput, SamplingSpec, TokenLogprobs
from raykv.model.decoder import AllReduce, Decoder, SequenceChunk
from raykv.model.sampling import SamplingParams, sample_token
from raykv.model.spec import ModelSpec, UnsupportedModel

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_weights(path: Path, cache_dir: str | None = None) -> tuple[ModelSpec, Mapping[str, Any]]:
    """A checkpoint's description and tensors (lazy where the file allows): a Hugging Face
    directory, or a GGUF file dequantized once into ``cache_dir``."""
    from raykv.model.weights import load_gguf_weights, load_hf_directory

    if path.is_dir():
        return load_hf_directory(path)
    return load_gguf_weights(path, cache_dir)


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
        cache_dir: str | None = None,
    ) -> None:
        """``cache_dir``: where a GGUF file's dequantized weights are kept (None: nowhere)."""
        spec, weights = load_weights(path, cache_dir)
        self.spec = spec
        try:
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
        except UnsupportedModel as exc:  # a tensor missing: name the checkpoint it is missing from
            raise UnsupportedModel(f"{path}: {exc}") from None

    def step(self, kv: torch.Tensor, batch: list[ModelEntry]) -> ModelOutput:
        """Compute the batch; the sampled token of each sampling entry (0 for the others) and,
        where its request asks for them, the logprobs."""
        chunks = [SequenceChunk(e.tokens, e.start, e.block_tables, sample=e.samples) for e in batch]
        with torch.inference_mode():
            logits = iter(self.decoder.forward(chunks, kv))
        out = ModelOutput([], [])
        for e in batch:
            if not e.samples:
                out.samples.append(0)
                out.logprobs.append(None)
                continue
            spec = e.sampling or SamplingSpec()
            row = next(logits)
            try:
                sample = sample_token(row, _params(spec), e.end)
            except Exception:
                # this request's sampling alone is at fault: it fails, the step goes on
                log.exception("sampling failed for batch entry %d (%r)", e.req_index, spec)
                out.samples.append(SAMPLE_FAILED)
                out.logprobs.append(None)
                continue
            out.samples.append(sample.token_id)
            wanted = spec.logprobs is not None
            out.logprobs.append(TokenLogprobs(sample.logprob, sample.top) if wanted else None)
        return out


def _params(spec: SamplingSpec) -> SamplingParams:
    return SamplingParams(
        spec.temperature, spec.top_p, spec.top_k, spec.seed, logprobs=spec.logprobs or 0
    )
