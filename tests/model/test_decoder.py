"""The decoder on the paged KV cache against transformers' own forward pass, on tiny random
checkpoints that transformers makes and saves as safetensors (Llama with llama3 RoPE scaling,
tied and untied heads; Qwen2 with q/k/v bias; Qwen3 with q/k norms, an explicit head size and a
mix of full and sliding-window layers). Every generated position's log-probabilities must match
within 5e-4 in float32, however the sequence is cut into steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from raykv.model.decoder import Decoder, SequenceChunk  # noqa: E402
from raykv.model.spec import ModelSpec, UnsupportedModel  # noqa: E402
from raykv.model.weights import load_hf_directory  # noqa: E402

BLOCK = 4
TOLERANCE = 5e-4

SHAPE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def llama(tied: bool) -> object:
    return transformers.LlamaConfig(
        **SHAPE,
        tie_word_embeddings=tied,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )


def qwen2() -> object:
    return transformers.Qwen2Config(**SHAPE, tie_word_embeddings=False)


def qwen3() -> object:
    return transformers.Qwen3Config(
        **{**SHAPE, "num_hidden_layers": 3},
        head_dim=24,
        tie_word_embeddings=True,
        sliding_window=6,
        use_sliding_window=True,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    )


CONFIGS = {
    "llama-llama3-untied": lambda: llama(False),
    "llama-tied": lambda: llama(True),
    "qwen2-bias": qwen2,
    "qwen3-norms-sliding": qwen3,
    # as many KV heads as query heads: splits over 4 ranks
    "qwen2-mha": lambda: transformers.Qwen2Config(**{**SHAPE, "num_key_value_heads": 4}),
}


def checkpoint(tmp_path: Path, name: str) -> tuple[Path, object]:
    torch.manual_seed(0)
    cfg = CONFIGS[name]()
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path, model


def reference_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].to(torch.float32)
    return torch.log_softmax(logits, dim=-1)


def decode_token_by_token(decoder: Decoder, tokens: list[int]) -> torch.Tensor:
    """Feed ``tokens`` one per step, sampling after each (every step reads all earlier KV back
    from the pages); returns every position's log-probabilities."""
    groups = len(decoder.group_windows)
    blocks = -(-len(tokens) // BLOCK)
    kv = torch.zeros(1 + blocks * groups, *decoder.page_shape).view(1 + blocks * groups, -1)
    tables = [[1 + g * blocks + b for b in range(blocks)] for g in range(groups)]
    logits = [
        decoder.forward([SequenceChunk(tokens[pos : pos + 1], pos, tables)], kv)[0]
        for pos in range(len(tokens))
    ]
    return torch.log_softmax(torch.stack(logits), dim=-1)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_token_by_token_decoding_matches_transformers(tmp_path: Path, name: str) -> None:
    path, model = checkpoint(tmp_path, name)
    spec, weights = load_hf_directory(path)
    decoder = Decoder(spec, weights, BLOCK)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SHAPE["vocab_size"], (19,), generator=gen).tolist()
    ours = decode_token_by_token(decoder, tokens)
    theirs = reference_logprobs(model, tokens)
    assert (ours - theirs).abs().max().item() < TOLERANCE


class _Reads(dict):
    """The checkpoint's tensors, noting the name of each one read."""

    def __init__(self, weights) -> None:
        super().__init__(weights)
        self.read: list[str] = []

    def __getitem__(self, name: str):
        self.read.append(name)
        return super().__getitem__(name)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_tensors_a_spec_requires_are_those_the_decoder_reads(tmp_path: Path, name: str) -> None:
    """``ModelSpec.required_tensors`` is what a checkpoint is checked for before any rank
    loads it: it must name every tensor the decoder reads, and nothing it does not."""
    path, _ = checkpoint(tmp_path, name)
    spec, weights = load_hf_directory(path)
    reads = _Reads(weights)
    Decoder(spec, reads, BLOCK)
    assert reads.read == spec.required_tensors()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chunked_prefill_and_a_batch_of_requests_match_transformers(
    tmp_path: Path, name: str
) -> None:
    path, model = checkpoint(tmp_path, name)
    spec, weights = load_hf_directory(path)
    decoder = Decoder(spec, weights, BLOCK)
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, SHAPE["vocab_size"], (17,), generator=gen).tolist()
    b = torch.randint(0, SHAPE["vocab_size"], (11,), generator=gen).tolist()
    groups = len(decoder.group_windows)
    kv = torch.zeros(64, *decoder.page_shape).view(64, -1)
    # disjoint, scattered blocks for the two requests and each of their groups
    table_a = [[1 + 2 * b + 16 * g for b in range(5)] for g in range(groups)]
    table_b = [[2 + 2 * b + 16 * g for b in range(3)] for g in range(groups)]
    # step 1: a's first 7 tokens (no sample) beside b's first 10 (sample)
    first = decoder.forward(
        [SequenceChunk(a[:7], 0, table_a, sample=False), SequenceChunk(b[:10], 0, table_b)], kv
    )
    # step 2: a's next 10 tokens (a chunk from position 7), b decodes its last token
    second = decoder.forward(
        [SequenceChunk(a[7:], 7, table_a), SequenceChunk(b[10:], 10, table_b)], kv
    )
    ref_a, ref_b = reference_logprobs(model, a), reference_logprobs(model, b)
    got = torch.log_softmax(torch.stack([first[0], second[0], second[1]]), dim=-1)
    want = torch.stack([ref_b[9], ref_a[16], ref_b[10]])
    assert first.shape[0] == 1 and second.shape[0] == 2
    assert (got - want).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decodes_of_different_lengths_in_one_step_match_transformers(
    tmp_path: Path, name: str
) -> None:
    """A step's decode tokens attend as one padded batch: requests of 1 to 4 blocks (past the
    Qwen3 checkpoint's window of 6), with a prompt chunk between them in the step, so their
    rows are not contiguous and each reads only its own positions."""
    path, model = checkpoint(tmp_path, name)
    spec, weights = load_hf_directory(path)
    decoder = Decoder(spec, weights, BLOCK)
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 13, 6, 22]
    prompts = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in lengths]
    other = torch.randint(0, SHAPE["vocab_size"], (9,), generator=gen).tolist()
    groups = len(decoder.group_windows)
    kv = torch.zeros(128, *decoder.page_shape).view(128, -1)
    # request r's block b of group g: scattered, disjoint
    tables = [[[1 + r + 6 * b + 40 * g for b in range(6)] for g in range(groups)] for r in range(5)]
    for r, prompt in enumerate(prompts):  # every prompt but its last token, one request a step
        decoder.forward([SequenceChunk(prompt[:-1], 0, tables[r], sample=False)], kv)
    chunks = [SequenceChunk(p[-1:], len(p) - 1, tables[r]) for r, p in enumerate(prompts)]
    chunks.insert(2, SequenceChunk(other, 0, tables[4]))
    got = torch.log_softmax(decoder.forward(chunks, kv), dim=-1)
    want = [reference_logprobs(model, p)[-1] for p in prompts]
    want.insert(2, reference_logprobs(model, other)[-1])
    assert got.shape[0] == 5
    assert (got - torch.stack(want)).abs().max().item() < TOLERANCE


def test_the_sliding_window_layers_are_read_as_a_window(tmp_path: Path) -> None:
    """The Qwen3 checkpoint's last two layers attend to a window of 6: reading them as full
    attention gives other log-probabilities (so the comparisons above do check the window)."""
    path, model = checkpoint(tmp_path, "qwen3-norms-sliding")
    spec, weights = load_hf_directory(path)
    assert spec.windows == (None, 6, 6)
    decoder = Decoder(spec, weights, BLOCK)
    decoder.group_windows = [None, None]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SHAPE["vocab_size"], (19,), generator=gen).tolist()
    ours = decode_token_by_token(decoder, tokens)
    assert (ours - reference_logprobs(model, tokens)).abs().max().item() > 1e-3


def test_an_unsupported_model_type_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedModel, match="model_type 'gpt2' is not supported"):
        ModelSpec.from_hf_config({"model_type": "gpt2"})


class ThreadAllReduce:
    """A sum over ranks that run in threads of this process (the real group is gloo or NCCL;
    the arithmetic under test is the decoder's sharding, not the transport)."""

    def __init__(self, ranks: int) -> None:
        import threading

        self.barrier = threading.Barrier(ranks)
        self.parts: list[torch.Tensor | None] = [None] * ranks
        self.ranks = ranks

    def for_rank(self, rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x
            self.barrier.wait()
            total = sum(p for p in self.parts if p is not None)
            self.barrier.wait()  # every rank has read the parts before the next call
            return total

        return all_reduce


@pytest.mark.parametrize("name", ["llama-llama3-untied", "qwen2-bias", "qwen3-norms-sliding"])
def test_two_tensor_parallel_ranks_match_transformers(tmp_path: Path, name: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    path, model = checkpoint(tmp_path, name)
    spec, weights = load_hf_directory(path)
    group = ThreadAllReduce(2)
    ranks = [
        Decoder(spec, weights, BLOCK, rank=r, tp_size=2, all_reduce=group.for_rank(r))
        for r in range(2)
    ]
    assert ranks[0].page_shape[2] == spec.num_kv_heads // 2  # each rank pages its KV heads
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, SHAPE["vocab_size"], (13,), generator=gen).tolist()
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda d: decode_token_by_token(d, tokens), ranks))
    assert torch.equal(results[0], results[1])  # the same logits on every rank
    assert (results[0] - reference_logprobs(model, tokens)).abs().max().item() < TOLERANCE


def test_a_tp_size_that_does_not_split_the_heads_is_refused_with_the_counts(tmp_path) -> None:
    path, _ = checkpoint(tmp_path, "llama-tied")
    spec, weights = load_hf_directory(path)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4"):
        Decoder(spec, weights, BLOCK, rank=0, tp_size=3, all_reduce=lambda x: x)
