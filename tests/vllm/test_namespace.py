"""The namespace of raykv's disk and shared tiers inside vLLM is what runs (``raykv/vllm/
namespace.py``): a model vLLM changes at start (``hf_overrides``) or whose weights change while
it runs (an RLHF step: ``apply_model``, then ``reset_prefix_cache(reset_connector=True)``) never
loads KV of the model it was, and never writes its own under the old model's name; replicas that
hold the same weights share again. Each answer is checked against vLLM alone with the same
settings: greedy tokens and logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.conftest import (
    BLOCK_TOKENS,
    answer,
    drain,
    engine,
    manager_of,
    prompt_text,
    worker_of,
)
from tests.vllm.test_tiers import SECRET, same

PROMPT = prompt_text(5)
# vLLM's hf_overrides as an operator stretching the context would give them: the tiny model's
# rotary base (10,000) ten times over (its config says it as transformers 5 does)
OVERRIDES = {"hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}}


def perturb(model) -> None:
    """An update of the weights in place, as a training step makes one."""
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".layers.0." in name:
                parameter.mul_(1.25)


def run(model: Path, settings: dict | None, script, **overrides) -> object:
    """``script(llm)`` on an engine of its own (one per call: a caller's name still bound to a
    shut-down ``LLM`` would free vLLM's process-global state under the next engine)."""
    with engine(model, settings, **overrides) as llm:
        return script(llm)


@pytest.fixture(scope="module")
def vllm_alone(vllm_model) -> dict[str, tuple[list[int], list[float]]]:
    """vLLM without offloading: the model as it is, with the overrides, and after ``perturb``."""

    def before_and_after(llm):
        first = answer(llm, PROMPT)[:2]
        llm.apply_model(perturb)
        llm.reset_prefix_cache()  # vLLM's own cache holds the KV of the weights before
        return first, answer(llm, PROMPT)[:2]

    first, updated = run(vllm_model, None, before_and_after)
    overridden = run(vllm_model, None, lambda llm: answer(llm, PROMPT)[:2], **OVERRIDES)
    assert updated[1] != first[1] and overridden[1] != first[1], "the changes change nothing"
    return {"first": first, "updated": updated, "overridden": overridden}


def namespaces(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_dir())


def stored(llm) -> None:
    answer(llm, PROMPT)
    drain(llm)


def test_a_model_overridden_at_start_has_a_namespace_of_its_own(
    vllm_model, vllm_alone, tmp_path
) -> None:
    """Found by an audit: an engine with another rope_theta on the same disk path loaded all of
    the first engine's KV (other tokens, |dlogprob| up to 3.3)."""
    settings = {"cpu_bytes": "16MiB", "disk": {"enabled": True, "path": str(tmp_path)}}
    run(vllm_model, settings, stored)

    def overridden(llm) -> None:
        got = answer(llm, PROMPT)
        assert got[2] == 0, "KV of the model without the override was loaded"
        same(got, vllm_alone["overridden"])
        assert manager_of(llm).disk.stats().loads == 0

    run(vllm_model, settings, overridden, **OVERRIDES)
    assert len(namespaces(tmp_path)) == 2


def test_a_weight_update_and_a_reset_move_the_engine_to_its_new_weights_namespace(
    vllm_model, vllm_alone, shared_store, monkeypatch, tmp_path
) -> None:
    """The RLHF pattern with every tier (CPU, disk and a store that outlives the engines):
    after update and reset nothing stored before is loaded (the store's parts were: other
    tokens, |dlogprob| up to 3.2), what the new weights store is served under their own
    namespace, the old namespace keeps the old weights' KV (an engine still on them loads it
    and answers right), and an engine that makes the same update shares the new one."""
    monkeypatch.setenv("RAYKV_SHARED_SECRET", SECRET)
    settings = {
        "cpu_bytes": "16MiB",
        "disk": {"enabled": True, "path": str(tmp_path)},
        "shared": {"enabled": True, "master": shared_store, "mount": False, "segment": "64MiB"},
    }

    def updated(llm) -> None:
        same(answer(llm, PROMPT), vllm_alone["first"])
        drain(llm)
        llm.apply_model(perturb)
        assert llm.reset_prefix_cache(reset_connector=True)
        got = answer(llm, PROMPT)
        assert got[2] == 0, "KV of the weights before the update was loaded"
        same(got, vllm_alone["updated"])
        drain(llm)
        llm.reset_prefix_cache()  # the GPU's copies gone: the tiers have what the update stored
        again = answer(llm, PROMPT)
        assert again[2] >= BLOCK_TOKENS
        same(again, vllm_alone["updated"])

    run(vllm_model, settings, updated)
    assert len(namespaces(tmp_path)) == 2

    def as_they_were(llm) -> None:  # the weights before the update: their own KV
        got = answer(llm, PROMPT)
        assert got[2] >= BLOCK_TOKENS and manager_of(llm).disk.stats().loads > 0
        same(got, vllm_alone["first"])

    run(vllm_model, settings, as_they_were)

    def same_update(llm) -> None:  # a replica making the same update shares its KV
        llm.apply_model(perturb)
        assert llm.reset_prefix_cache(reset_connector=True)
        got = answer(llm, PROMPT)
        assert got[2] >= BLOCK_TOKENS
        same(got, vllm_alone["updated"])

    run(vllm_model, settings, same_update)


@pytest.fixture(scope="module")
def bin_model(tmp_path_factory, smollm2_hf_tokenizer) -> Path:
    """The tiny test model with its weights in ``pytorch_model.bin`` only (which vLLM serves)."""
    import torch
    import transformers

    out = tmp_path_factory.mktemp("vllm-tiny-llama-bin")
    smollm2_hf_tokenizer.save_pretrained(out)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(smollm2_hf_tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=smollm2_hf_tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    config.save_pretrained(out)
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    return out


def test_a_model_of_bin_weights_starts_with_the_disk_tier(bin_model, tmp_path) -> None:
    """Found by an audit: the namespace fingerprinted safetensors files only, and a directory
    of ``pytorch_model.bin`` was refused at start (a traceback of 26 frames)."""
    settings = {"cpu_bytes": "16MiB", "disk": {"enabled": True, "path": str(tmp_path)}}

    def served(llm) -> None:
        stored(llm)
        assert worker_of(llm).lower, "the disk tier did not start"
        llm.reset_prefix_cache()
        assert answer(llm, PROMPT)[2] >= BLOCK_TOKENS

    run(bin_model, settings, served)
    assert len(namespaces(tmp_path)) == 1
