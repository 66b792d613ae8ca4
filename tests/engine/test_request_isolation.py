"""One request cannot take the engine down (issue 28, finding 1): its sampling parameters are
checked where it enters, the sampler computes any temperature it accepts, and a request whose
sampling raises on a rank anyway fails alone: it ends with ``FINISHED_ERROR`` after the tokens
it had, and every other request gets exactly the tokens it gets without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from raykv.cli import main
from raykv.config import load_config
from raykv.core.request import Request, RequestRefused, RequestStatus
from raykv.core.step import SEED_MAX, SamplingError, SamplingSpec
from raykv.engine.core import EngineCore
from raykv.engine.workers import LocalWorkerGroup
from raykv.model import backend
from raykv.model.checkpoint import configure
from raykv.model.sampling import SamplingParams, sample_token
from raykv.runs.driver import Driver
from raykv.workload.requests import RequestSpec
from tests.model.test_decoder import SHAPE, checkpoint

POISON_SEED = 666
PROMPT = 9


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (SamplingSpec(seed=2**64), "seed"),
        (SamplingSpec(seed=SEED_MAX + 1), "seed"),
        (SamplingSpec(seed=-(2**63) - 1), "seed"),
        (SamplingSpec(temperature=float("nan")), "temperature"),
        (SamplingSpec(temperature=float("inf")), "temperature"),
        (SamplingSpec(temperature=-0.5), "temperature"),
        (SamplingSpec(top_p=float("nan")), "top_p"),
        (SamplingSpec(top_p=0.0), "top_p"),
        (SamplingSpec(top_k=-1), "top_k"),
        (SamplingSpec(top_k=2**64), "top_k"),  # past what the step message carries
        (SamplingSpec(logprobs=21), "logprobs"),
        (SamplingSpec(logprobs=-1), "logprobs"),
    ],
)
def test_issue28_1_what_the_engine_cannot_carry_or_compute_is_refused_naming_it(
    spec: SamplingSpec, field: str
) -> None:
    with pytest.raises(SamplingError) as info:
        spec.check()
    assert info.value.field == field
    cfg = load_config(None, ["cache.num_gpu_blocks=16", "cache.block_size=4"])
    with LocalWorkerGroup(cfg, 4, threaded=False) as workers:
        engine = EngineCore(cfg, workers)
        with pytest.raises(RequestRefused, match=f"request bad: {field}") as refused:
            engine.add_request(Request("bad", 0, [1, 2, 3], 2, sampling=spec))
        assert refused.value.field == field
        assert not engine.has_work()


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 5e-324, 1e-300])
def test_issue28_1_a_positive_temperature_too_small_for_float32_samples_the_argmax(
    temperature: float,
) -> None:
    logits = torch.randn(500, generator=torch.Generator().manual_seed(3)) * 4
    for top_p, top_k in ((1.0, 0), (0.9, 40)):
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=5)
        assert sample_token(logits, params, 11).token_id == int(logits.argmax())


def serve(cfg, specs: list[RequestSpec]) -> dict[str, Request]:
    with LocalWorkerGroup(cfg, cfg.cpu_slots(), threaded=False) as workers:
        engine = EngineCore(cfg, workers)
        driver = Driver(engine, check_invariants=True)
        driver.submit(specs)
        done: dict[str, Request] = {}
        while driver.has_work():
            driver.step()
            done.update((r.req_id, r) for r in driver.take_finished())
        assert engine.totals.failed_requests == sum(
            r.status is RequestStatus.FINISHED_ERROR for r in done.values()
        )
    return done


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_issue28_1_a_request_whose_sampling_raises_on_a_rank_fails_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    path, _ = checkpoint(tmp_path, "llama-llama3-untied")
    sets = [
        f"model.path={path}",
        "model.dtype=float32",
        "cache.block_size=4",
        "cache.num_gpu_blocks=48",
        "offload.cpu_slots=32",
        f"engine.async_scheduling={str(async_scheduling).lower()}",
    ]
    cfg, _, _ = configure(load_config(None, sets))
    gen = torch.Generator().manual_seed(2)

    def spec(name: str, seed: int) -> RequestSpec:
        prompt = torch.randint(1, SHAPE["vocab_size"], (PROMPT,), generator=gen).tolist()
        return RequestSpec(name, tuple(prompt), 8, 0, SamplingSpec(1.0, 0.9, 0, seed))

    others = [spec(f"r{i}", 10 + i) for i in range(4)]
    poison = spec("poison", POISON_SEED)
    alone = serve(cfg, others)
    # Nothing a request carries makes sampling raise any more (every field is checked where it
    # enters), so a stand-in forces it: sampling raises for the poison request's third token,
    # as a bug in the sampler would.
    real = backend.sample_token

    def sample(logits, params, position):
        if params.seed == POISON_SEED and position >= PROMPT + 2:
            raise RuntimeError("the sampler failed")
        return real(logits, params, position)

    monkeypatch.setattr(backend, "sample_token", sample)
    together = serve(cfg, [others[0], poison, *others[1:]])
    failed = together.pop("poison")
    assert failed.status is RequestStatus.FINISHED_ERROR
    assert len(failed.output) == 2  # the two tokens sampled before the failure
    assert {k: r.output for k, r in together.items()} == {k: r.output for k, r in alone.items()}
    assert all(r.status is not RequestStatus.FINISHED_ERROR for r in together.values())


def test_issue28_1_generate_names_a_seed_past_64_bits_and_a_temperature_it_cannot_use(
    tmp_path: Path, capsys
) -> None:
    path, _ = checkpoint(tmp_path / "ckpt", "llama-tied")
    capsys.readouterr()  # what saving the checkpoint printed
    file = tmp_path / "prompts.jsonl"
    file.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    base = ["generate", "--model", str(path), "--prompt-file", str(file), "--max-tokens", "3"]
    for flags, flag in (
        (["--seed", str(2**70)], "--seed"),
        (["--seed", str(-(2**63) - 1)], "--seed"),
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--logprobs", "50"], "--logprobs"),
        (["--top-k", str(2**64)], "--top-k"),
        (["--max-tokens", str(10**30)], "--max-tokens"),
    ):
        assert main([*base, *flags]) == 2
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    greedy_out, tiny_out = tmp_path / "greedy.json", tmp_path / "tiny.json"
    assert main([*base, "--json", str(greedy_out)]) == 0
    assert main([*base, "--temperature", "1e-40", "--seed", "1", "--json", str(tiny_out)]) == 0
    # seeds near the top of the range wrap for the later prompts instead of overflowing
    two = tmp_path / "two.jsonl"
    two.write_text('{"prompt_token_ids": [1, 2, 3]}\n{"prompt_token_ids": [4, 5]}\n')
    wrapped = [*base[:4], str(two), *base[5:], "--temperature", "1", "--seed", str(SEED_MAX)]
    assert main(wrapped) == 0

    tokens = [json.loads(f.read_text())["outputs"][0]["token_ids"] for f in (greedy_out, tiny_out)]
    assert tokens[0] == tokens[1]
