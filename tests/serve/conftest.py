"""A served tiny model for the serving tests: random Llama weights (made here with
transformers) beside SmolLM2's real tokenizer and chat template, so prompts are real text and
answers are fast."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_tokenizer) -> Path:
    import torch

    out = tmp_path_factory.mktemp("tiny-chat-model")
    tokenizer = smollm2_hf_tokenizer
    tokenizer.save_pretrained(out)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out
