"""A real model in the one-process engine (TP=1): greedy tokens equal transformers' generate,
also when a request's prefix comes back from the CPU tier instead of being recomputed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from raykv.config import load_config  # noqa: E402
from raykv.core.request import Request  # noqa: E402
from raykv.engine.core import EngineCore  # noqa: E402
from raykv.engine.workers import LocalWorkerGroup  # noqa: E402
from raykv.model.checkpoint import configure  # noqa: E402
from tests.model.test_decoder import SHAPE, checkpoint  # noqa: E402


def expected(model, prompt: list[int], n: int, eos: tuple[int, ...]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=list(eos) or None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, stopping at the checkpoint's EOS as raykv does."""
    eos = model.config.eos_token_id
    return expected(model, prompt, n, (eos,) if eos is not None else ())


@pytest.mark.parametrize("name", ["llama-llama3-untied", "qwen3-norms-sliding"])
def test_the_engine_generates_what_transformers_does_with_the_cpu_tier(
    tmp_path: Path, name: str
) -> None:
    path, model = checkpoint(tmp_path, name)
    sets = [
        f"model.path={path}",
        "model.dtype=float32",
        "cache.block_size=4",
        "cache.num_gpu_blocks=40",
        "offload.cpu_slots=64",
        "engine.max_num_batched_tokens=8",  # prompts are prefilled in several chunks
    ]
    cfg, spec, _ = configure(load_config(None, sets))
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, SHAPE["vocab_size"], (20,), generator=gen).tolist()
    first = [*shared, 7, 8, 9]
    second = [*shared, 11, 12]
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        engine = EngineCore(cfg, workers)  # configure put the EOS tokens in the config
        a = Request("a", 0, first, 6)
        engine.add_request(a)
        while engine.has_work():
            engine.step()
        engine.pool.reset_cache()  # the GPU prefix cache forgets a: the CPU tier has it
        b = Request("b", 1, second, 6)
        engine.add_request(b)
        while engine.has_work():
            engine.step()
        hits = engine.scheduler.stats.cpu_hit_tokens
    assert a.output == expected(model, first, 6, spec.eos_token_ids)
    assert b.output == expected(model, second, 6, spec.eos_token_ids)
    assert hits >= 16  # b's shared prefix was loaded, not recomputed
