"""A served tiny model for the serving tests: random Llama weights (made here with
transformers) beside SmolLM2's real tokenizer and chat template, so prompts are real text and
answers are fast."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")


def tiny_llama(
    out: Path, tokenizer, context: int, seed: int, hidden_size: int = 64, kv_heads: int = 2
) -> Path:
    """Random two-layer Llama weights (four heads) for ``tokenizer``'s vocabulary, saved with
    it in ``out``."""
    import torch

    tokenizer.save_pretrained(out)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_tokenizer) -> Path:
    out = tmp_path_factory.mktemp("tiny-chat-model")
    return tiny_llama(out, smollm2_hf_tokenizer, context=2048, seed=0)


# A chat template of the kind Mistral's and Llama 2's are: it raises on roles that do not
# alternate (written here for the test, in ChatML's tokens so SmolLM2's tokenizer has them).
ALTERNATING_TEMPLATE = (
    "{%- set offset = 1 if messages[0]['role'] == 'system' else 0 %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('a system message may only come first') }}"
    "{%- elif message['role'] != 'system' and "
    "(message['role'] == 'user') != ((loop.index0 - offset) % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="session")
def long_context_model(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_tokenizer) -> Path:
    """The tiny model with a 128k-token context (a megabyte prompt is tokenized, not refused
    from its length) and a chat template that raises on roles that do not alternate."""
    import copy

    tokenizer = copy.deepcopy(smollm2_hf_tokenizer)
    tokenizer.chat_template = ALTERNATING_TEMPLATE
    return tiny_llama(tmp_path_factory.mktemp("long-context-model"), tokenizer, 131072, seed=1)
