"""The real model on CUDA: the decoder against transformers on the same device (float32 within
the CPU tolerance; SmolLM2 in bfloat16 within a bfloat16 tolerance), and ``raykv generate`` on
a CUDA rank with a prefix loaded from the pinned CPU tier. Run by ``scripts/gpu_check.sh``; the
bfloat16 bounds are first estimates until a GPU run measures them (the run prints them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from raykv.cli import main  # noqa: E402
from raykv.model.decoder import Decoder, SequenceChunk  # noqa: E402
from raykv.model.presets import preset_path  # noqa: E402
from raykv.model.spec import UnsupportedModel  # noqa: E402
from raykv.model.weights import load_gguf_weights, load_hf_directory  # noqa: E402
from tests.model.test_decoder import BLOCK, SHAPE, TOLERANCE, checkpoint  # noqa: E402
from tests.model.test_engine_llm import greedy  # noqa: E402

CUDA = "cuda"


def _forward_all(decoder: Decoder, tokens: list[int]) -> torch.Tensor:
    """Every position's log-probabilities, one token per step (each step reads all earlier KV
    back from the pages on the GPU)."""
    groups = len(decoder.group_windows)
    blocks = -(-len(tokens) // decoder.block_size)
    pages = 1 + blocks * groups
    kv = torch.zeros(pages, *decoder.page_shape, device=CUDA, dtype=decoder.dtype).view(pages, -1)
    tables = [[1 + g * blocks + b for b in range(blocks)] for g in range(groups)]
    out = [
        decoder.forward([SequenceChunk(tokens[pos : pos + 1], pos, tables)], kv)[0].float()
        for pos in range(len(tokens))
    ]
    return torch.log_softmax(torch.stack(out), dim=-1)


@pytest.mark.parametrize("name", ["llama-llama3-untied", "qwen3-norms-sliding"])
def test_the_decoder_on_cuda_matches_transformers_in_float32(tmp_path: Path, name: str) -> None:
    path, model = checkpoint(tmp_path, name)
    spec, weights = load_hf_directory(path)
    ours = Decoder(spec, weights, BLOCK, torch.float32, CUDA)
    tokens = torch.randint(
        1, SHAPE["vocab_size"], (20,), generator=torch.Generator().manual_seed(3)
    )
    tokens = tokens.tolist()
    theirs = model.to(CUDA)
    with torch.no_grad():
        want = torch.log_softmax(theirs(torch.tensor([tokens], device=CUDA)).logits[0], dim=-1)
    got = _forward_all(ours, tokens)
    assert (got - want).abs().max().item() < TOLERANCE


def test_smollm2_in_bfloat16_on_cuda_is_close_to_transformers(tmp_path: Path) -> None:
    try:
        path = preset_path("smollm2-135m-instruct")
    except UnsupportedModel as exc:
        pytest.skip(str(exc))
    spec, weights = load_gguf_weights(path, tmp_path)
    ours = Decoder(spec, weights, 16, torch.bfloat16, CUDA)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.bfloat16
    ).to(CUDA)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    with torch.no_grad():
        answer = theirs.generate(torch.tensor([ids], device=CUDA), max_new_tokens=10)
        sequence = answer[0].tolist()
        want = torch.log_softmax(theirs(answer).logits[0].float(), dim=-1)
    got = _forward_all(ours, sequence)
    positions = range(len(ids) - 1, len(sequence) - 1)
    diffs = [abs(got[p, sequence[p + 1]] - want[p, sequence[p + 1]]).item() for p in positions]
    print(f"bfloat16 logprob differences: max {max(diffs):.4f}, mean {sum(diffs) / len(diffs):.4f}")
    assert tokenizer.decode(sequence[len(ids) :]).startswith("The capital of France is Paris")
    assert max(diffs) < 0.25 and sum(diffs) / len(diffs) < 0.08


def test_generate_on_a_cuda_rank_reloads_a_prefix_from_the_cpu_tier(tmp_path: Path) -> None:
    path, model = checkpoint(tmp_path / "ckpt", "llama-llama3-untied")
    gen = torch.Generator().manual_seed(9)
    shared = torch.randint(1, SHAPE["vocab_size"], (24,), generator=gen).tolist()
    other = torch.randint(1, SHAPE["vocab_size"], (28,), generator=gen).tolist()
    prompts = [[*shared, 3], other, [*shared, 4, 5]]
    file = tmp_path / "prompts.jsonl"
    file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "out.json"
    argv = ["generate", "--model", str(path), "--prompt-file", str(file), "--sequential"]
    argv += ["--max-tokens", "5", "--json", str(out)]
    for s in ("parallel.device=cuda", "cache.block_size=4", "cache.num_gpu_blocks=12"):
        argv += ["--set", s]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    for prompt, got in zip(prompts, result["outputs"], strict=True):
        assert got["token_ids"] == greedy(model, prompt, 5)
    assert result["report"]["cpu_hit_tokens"] > 0
