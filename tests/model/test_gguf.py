"""GGUF checkpoints, written here in llama.cpp's conventions (``llama`` metadata, ``blk.N.*``
tensor names, q/k rows permuted the way its converter permutes them, 2-D weights quantized):

* ``load_gguf`` reads the metadata into the same ModelSpec as the Hugging Face config, and its
  weights, through our decoder, give the log-probabilities of the quantized weights in Hugging
  Face order (dequantized here, never permuted) within 1e-5, for F32, F16, BF16, Q8_0, Q4_0 and
  Q4_1; for F32 and Q8_0 they also equal transformers loading the same file, and for F32 the
  original model's own forward (5e-4).
* ``load_gguf_weights`` dequantizes once into its cache: a second start reads the cached file
  without dequantizing, a changed file gets a new entry, no cache directory writes nothing.
* An architecture the decoder does not have is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from raykv.model.decoder import Decoder  # noqa: E402
from raykv.model.gguf_file import load_gguf  # noqa: E402
from raykv.model.spec import ModelSpec, UnsupportedModel  # noqa: E402
from raykv.model.weights import cached_gguf_path, load_gguf_weights  # noqa: E402
from tests.model.test_decoder import (  # noqa: E402
    BLOCK,
    SHAPE,
    TOLERANCE,
    decode_token_by_token,
    reference_logprobs,
)

EPS = 2.0**-16  # exact in float32, as GGUF stores it
THETA = 1000.0  # not the default 10000: the file's rope.freq_base must be read
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]


def hf_llama(seed: int = 0, rope: dict | None = None) -> torch.nn.Module:
    """A tiny random Llama (default RoPE unless ``rope`` says otherwise), with norm weights
    that are not all ones."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        **SHAPE,
        tie_word_embeddings=False,
        rms_norm_eps=EPS,
        initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": THETA, **(rope or {})},
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def gguf_name(hf: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{suffix}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter (``LlamaModel.permute``): interleave each head's rotary halves."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    qtype: Q,
    arch: str = "llama",
    linear_scaling: float | None = None,
    rope_freqs: np.ndarray | None = None,
) -> dict:
    """Write ``model`` as llama.cpp would, 2-D weights as ``qtype``; return the ground truth:
    every tensor dequantized from ``qtype`` in Hugging Face order (quantization is row-wise,
    so these are the very blocks the file holds, only in the rows' original order)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_rope_freq_base(THETA)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(cfg.eos_token_id)
    if linear_scaling is not None:  # as llama.cpp's converter writes linear RoPE scaling
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(linear_scaling)
    if rope_freqs is not None:  # and Llama 3's, as one divisor per rotary dimension pair
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    truth: dict[str, torch.Tensor] = {}
    for hf, param in model.state_dict().items():
        w = param.detach().numpy().astype(np.float32)
        if w.ndim == 1:  # norms stay F32
            writer.add_tensor(gguf_name(hf), w)
            truth[hf] = torch.from_numpy(w.copy())
            continue
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
        stored = w
        for proj, n in heads.items():
            if f".{proj}." in hf:
                stored = permute(w, n)
        data = quantize(stored, qtype)
        writer.add_tensor(gguf_name(hf), data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        truth[hf] = torch.from_numpy(dequantize(quantize(w, qtype), qtype).reshape(w.shape).copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return truth


def tokens(n: int = 19, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen).tolist()


def hf_spec(model: torch.nn.Module) -> ModelSpec:
    return ModelSpec.from_hf_config(json.loads(model.config.to_json_string()))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return hf_llama()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_load_gguf_matches_the_dequantized_weights_and_transformers(
    tmp_path: Path, model: torch.nn.Module, qtype: Q
) -> None:
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    truth = write_gguf(path, model, qtype)
    spec, weights, _ = load_gguf(path)
    assert spec == hf_spec(model)
    assert sorted(weights) == sorted(truth)
    ids = tokens()
    ours = decode_token_by_token(Decoder(spec, weights, BLOCK), ids)
    want = decode_token_by_token(Decoder(hf_spec(model), truth, BLOCK), ids)
    diff = (ours - want).abs().max().item()
    print(f"{qtype.name}: ours vs dequantized ground truth {diff:.2e}")
    assert diff < 1e-5
    if qtype not in (Q.F32, Q.Q8_0):
        return
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    diff = (ours - reference_logprobs(theirs, ids)).abs().max().item()
    print(f"{qtype.name}: ours vs transformers on the GGUF file {diff:.2e}")
    assert diff < TOLERANCE
    if qtype == Q.F32:
        diff = (ours - reference_logprobs(model, ids)).abs().max().item()
        print(f"F32: ours vs the original model {diff:.2e}")
        assert diff < TOLERANCE


def test_the_rotary_permutation_matters(tmp_path: Path, model: torch.nn.Module) -> None:
    """Read with q/k left in llama.cpp's order, the model gives other log-probabilities: the
    comparisons above do check that the loader undoes the permutation."""
    path = tmp_path / "tiny.gguf"
    truth = write_gguf(path, model, Q.F32)
    spec = hf_spec(model)
    raw = dict(truth)
    for i in range(spec.num_layers):
        for proj, n in (("q_proj", spec.num_heads), ("k_proj", spec.num_kv_heads)):
            key = f"model.layers.{i}.self_attn.{proj}.weight"
            raw[key] = torch.from_numpy(permute(truth[key].numpy(), n))
    ids = tokens()
    right = decode_token_by_token(Decoder(spec, truth, BLOCK), ids)
    wrong = decode_token_by_token(Decoder(spec, raw, BLOCK), ids)
    assert (right - wrong).abs().max().item() > 1e-3


def test_the_weights_cache_is_made_once_and_follows_the_file(
    tmp_path: Path, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    write_gguf(path, model, Q.Q8_0)
    spec, first = load_gguf_weights(path, cache)
    first_entry = cached_gguf_path(path, cache)
    assert first_entry.is_file()
    with monkeypatch.context() as m:
        # a second start must not dequantize anything: it reads the cached safetensors
        def refuse(*args: object) -> None:
            raise AssertionError("dequantized again")

        m.setattr(gguf.quants, "dequantize", refuse)
        # nor read the file's metadata (its vocabulary): the config is kept in the entry
        m.setattr(gguf, "GGUFReader", refuse)
        again_spec, again = load_gguf_weights(path, cache)
        assert again_spec == spec
        assert sorted(again) == sorted(first)
        for name, tensor in first.items():
            assert torch.equal(again[name][:], tensor), name
    other = hf_llama(seed=5)
    truth = write_gguf(path, other, Q.F32)  # another size: the cache must not serve the old file
    _, changed = load_gguf_weights(path, cache)
    second_entry = cached_gguf_path(path, cache)
    assert second_entry != first_entry and second_entry.is_file() and first_entry.is_file()
    _, expected, _ = load_gguf(path)
    assert torch.equal(expected["lm_head.weight"], truth["lm_head.weight"])
    for name, tensor in expected.items():
        assert torch.equal(changed[name][:], tensor), name
    _, cached = load_gguf_weights(path, cache)  # and it is the new entry that is read back
    for name, tensor in expected.items():
        assert torch.equal(cached[name][:], tensor), name


def test_a_gguf_files_config_is_read_once_and_follows_the_file(
    tmp_path: Path, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``configure`` (every command's start) keeps the config it read from the file's metadata;
    the next start reads the kept copy, until the file changes."""
    from raykv.config import load_config
    from raykv.model.checkpoint import configure

    path, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    write_gguf(path, model, Q.F32)
    cfg = load_config(None, [f"model.path={path}", f"model.weights_cache_dir={cache}"])
    _, spec, _ = configure(cfg)
    assert spec.num_layers == model.config.num_hidden_layers
    with monkeypatch.context() as m:

        def refuse(*args: object) -> None:
            raise AssertionError("the file's metadata was read again")

        m.setattr(gguf, "GGUFReader", refuse)
        _, again, _ = configure(cfg)
        assert again == spec
    other = hf_llama(seed=5)
    other.config.num_hidden_layers = 1  # what the changed file says, from its own metadata
    other.model.layers = other.model.layers[:1]
    write_gguf(path, other, Q.F32)
    _, changed, _ = configure(cfg)
    assert changed.num_layers == 1


def test_a_cache_entry_without_its_config_reads_the_config_from_the_file(
    tmp_path: Path, model: torch.nn.Module
) -> None:
    from safetensors.torch import load_file, save_file

    path, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    write_gguf(path, model, Q.Q8_0)
    spec, _ = load_gguf_weights(path, cache)
    entry = cached_gguf_path(path, cache)
    save_file(load_file(entry), str(entry), metadata={"source": str(path)})  # an older entry
    again_spec, again = load_gguf_weights(path, cache)
    assert again_spec == spec and sorted(again) == sorted(load_file(entry))


def test_no_cache_directory_dequantizes_into_memory_and_writes_nothing(
    tmp_path: Path, model: torch.nn.Module
) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, Q.Q4_0)
    before = sorted(tmp_path.rglob("*"))
    _, weights = load_gguf_weights(path, None)
    _, expected, _ = load_gguf(path)
    assert sorted(tmp_path.rglob("*")) == before
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_an_unsupported_architecture_is_refused_by_name(
    tmp_path: Path, model: torch.nn.Module
) -> None:
    path = tmp_path / "tiny-gpt2.gguf"
    write_gguf(path, model, Q.F32, arch="gpt2")
    with pytest.raises(UnsupportedModel, match="GGUF architecture 'gpt2' is not supported"):
        load_gguf(path)
    with pytest.raises(UnsupportedModel, match="'gpt2'"):
        load_gguf_weights(path, tmp_path / "cache")


def test_rope_scaling_in_a_gguf_file_is_read(tmp_path: Path) -> None:
    """Linear scaling from the metadata, Llama 3's from its ``rope_freqs`` tensor: each file
    gives the log-probabilities of the scaled model it came from (transformers' own GGUF
    loader reads neither, so the original model is the reference)."""
    from raykv.model.rope import inverse_frequencies
    from raykv.model.spec import RopeSpec

    ids = tokens(40)  # past the scaled wavelengths' effect on short sequences
    linear = hf_llama(rope={"rope_type": "linear", "factor": 4.0})
    path = tmp_path / "linear.gguf"
    write_gguf(path, linear, Q.F32, linear_scaling=4.0)
    spec, weights, _ = load_gguf(path)
    assert spec.rope.kind == "linear" and spec.rope.factor == 4.0
    ours = decode_token_by_token(Decoder(spec, weights, BLOCK), ids)
    assert (ours - reference_logprobs(linear, ids)).abs().max().item() < TOLERANCE

    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    scaled = hf_llama(rope=llama3)
    head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    plain = inverse_frequencies(RopeSpec(THETA), head_dim)
    wanted = inverse_frequencies(
        RopeSpec(THETA, "llama3", 8.0, 1.0, 4.0, original_max_positions=32), head_dim
    )
    path = tmp_path / "llama3.gguf"
    write_gguf(path, scaled, Q.F32, rope_freqs=(plain / wanted).numpy())
    spec, weights, _ = load_gguf(path)
    ours = decode_token_by_token(Decoder(spec, weights, BLOCK), ids)
    assert (ours - reference_logprobs(scaled, ids)).abs().max().item() < TOLERANCE
