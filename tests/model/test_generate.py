"""``raykv generate`` end to end on a tiny checkpoint (token-id prompts: it ships no
tokenizer): outputs equal transformers' greedy generation, later prompts reuse earlier KV from
the CPU tier with --sequential, and bad prompts are refused by name while the others run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from raykv.cli import main
from tests.model.test_decoder import SHAPE, checkpoint
from tests.model.test_engine_llm import greedy

# a short multi-turn chat on small blocks, for tiny checkpoints (``raykv run --model``)
SMALL_CHAT = (
    "cache.block_size=4",
    "workload.system_prompt_tokens=40",
    "workload.user_tokens=12",
    "workload.answer_tokens=8",
    "workload.max_tokens=4",
)


def assert_matches_transformers(model, prompt: list[int], got: dict, top: int) -> None:
    """One ``--json`` output against transformers: its greedy tokens, and every token's logprob
    (within 5e-4) and top ``top`` over the same sequence (the likeliest among them)."""
    assert got["token_ids"] == greedy(model, prompt, len(got["token_ids"]))
    sequence = [*prompt, *got["token_ids"]]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([sequence])).logits[0], dim=-1)
    assert len(got["logprobs"]) == len(got["token_ids"])
    for k, entry in enumerate(got["logprobs"]):
        want = ref[len(prompt) - 1 + k]
        assert entry["token_id"] == got["token_ids"][k]
        assert abs(entry["logprob"] - float(want[entry["token_id"]])) < 5e-4
        assert len(entry["top"]) == top and str(int(want.argmax())) in entry["top"]


def test_generate_sequential_prompts_match_transformers_and_hit_the_cpu_tier(
    tmp_path: Path,
) -> None:
    path, model = checkpoint(tmp_path / "ckpt", "llama-llama3-untied")
    gen = torch.Generator().manual_seed(9)
    shared = torch.randint(1, SHAPE["vocab_size"], (24,), generator=gen).tolist()
    other = torch.randint(1, SHAPE["vocab_size"], (28,), generator=gen).tolist()
    # the second prompt evicts the first from the GPU cache; the third shares the first's
    # prefix (found in the CPU tier); the last has a token id outside the vocabulary
    prompts = [[*shared, 3], other, [*shared, 4, 5], [SHAPE["vocab_size"] + 5]]
    file = tmp_path / "prompts.jsonl"
    file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "out.json"
    # a GPU pool so small that the second prompt's prefix is no longer cached on the GPU
    sets = ["cache.block_size=4", "cache.num_gpu_blocks=12", "offload.cpu_slots=64"]
    argv = ["generate", "--model", str(path), "--prompt-file", str(file), "--sequential"]
    argv += ["--max-tokens", "5", "--json", str(out), "--logprobs", "2"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    outputs = result["outputs"]
    for prompt, got in zip(prompts[:3], outputs[:3], strict=True):
        assert_matches_transformers(model, prompt, got, top=2)
    assert outputs[3]["finish_reason"] == "rejected" and "token id" in outputs[3]["error"]
    assert result["report"]["cpu_hit_tokens"] > 0


def test_a_bad_prompt_file_line_is_named(tmp_path: Path, capsys) -> None:
    path, _ = checkpoint(tmp_path / "ckpt", "llama-tied")
    file = tmp_path / "prompts.jsonl"
    file.write_text('{"prompt_token_ids": [1, 2]}\n{"prompt": 3}\n')
    code = main(["generate", "--model", str(path), "--prompt-file", str(file)])
    assert code == 2
    assert "prompts.jsonl:2: prompt has the wrong type" in capsys.readouterr().err


def test_a_seed_repeats_sampled_tokens_and_bad_parameters_are_named(tmp_path: Path, capsys):
    path, _ = checkpoint(tmp_path / "ckpt", "llama-tied")
    file = tmp_path / "prompts.jsonl"
    file.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    runs = []
    for seed in ("4", "4", "5"):
        out = tmp_path / f"out{len(runs)}.json"
        argv = ["generate", "--model", str(path), "--prompt-file", str(file), "--json", str(out)]
        argv += ["--max-tokens", "12", "--temperature", "1.5", "--seed", seed]
        assert main(argv) == 0
        runs.append(json.loads(out.read_text())["outputs"][0]["token_ids"])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    code = main(["generate", "--model", str(path), "--prompt-file", str(file), "--top-p", "0"])
    assert code == 2 and "top_p" in capsys.readouterr().err


def test_raykv_run_drives_a_real_model_through_the_cpu_tier(tmp_path: Path) -> None:
    path, _ = checkpoint(tmp_path / "ckpt", "qwen3-norms-sliding")
    out = tmp_path / "report.json"
    argv = ["run", "--engine", "local", "--config", "configs/synthetic.yaml", "--model", str(path)]
    argv += ["--num-requests", "12", "--json-report", str(out)]
    # a GPU pool too small to keep the conversations on the GPU
    for s in ("parallel.tensor_parallel_size=1", "cache.num_gpu_blocks=64", *SMALL_CHAT):
        argv += ["--set", s]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["requests_finished"] == 12 and report["generated_tokens"] > 0
    assert report["config"]["model"]["num_layers"] == 3  # the checkpoint's, not the config's
    assert report["cpu_hit_tokens"] > 0  # the multi-turn chat's history came from the CPU tier


def test_a_prompt_longer_than_the_context_is_refused_by_name_and_the_others_run(
    tmp_path: Path,
) -> None:
    path, _ = checkpoint(tmp_path / "ckpt", "llama-tied")
    context = SHAPE["max_position_embeddings"]
    file = tmp_path / "prompts.jsonl"
    lines = [[1, 2, 3], [5] * (context - 2), [4, 5, 6]]  # the middle one leaves no room
    file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in lines))
    out = tmp_path / "out.json"
    argv = ["generate", "--model", str(path), "--prompt-file", str(file), "--json", str(out)]
    argv += ["--max-tokens", "4", "--set", "cache.num_gpu_blocks=128"]
    assert main(argv) == 0
    outputs = json.loads(out.read_text())["outputs"]
    assert [o["finish_reason"] for o in outputs] == ["length", "rejected", "length"]
    assert f"exceed the model's context of {context}" in outputs[1]["error"]
    assert len(outputs[0]["token_ids"]) == len(outputs[2]["token_ids"]) == 4


def test_a_tp_size_the_checkpoint_cannot_split_is_refused_with_its_counts(
    tmp_path: Path, capsys
) -> None:
    path, _ = checkpoint(tmp_path / "ckpt", "llama-tied")  # 4 query heads, 2 KV heads
    argv = ["generate", "--model", str(path), "--prompt-file", "x.jsonl", "--engine", "ray"]
    argv += ["--set", "parallel.tensor_parallel_size=3"]
    file = tmp_path / "x.jsonl"
    file.write_text('{"prompt_token_ids": [1, 2]}\n')
    argv[4] = str(file)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "parallel.tensor_parallel_size 3 does not divide the model's 4 query heads" in err
    assert err.count("raykv: error") == 1 and "Traceback" not in err  # one line


def test_the_local_engine_refuses_a_real_model_at_tp2_naming_the_way_out(
    tmp_path: Path, capsys
) -> None:
    path, _ = checkpoint(tmp_path / "ckpt", "llama-tied")
    file = tmp_path / "x.jsonl"
    file.write_text('{"prompt_token_ids": [1, 2]}\n')
    argv = ["generate", "--model", str(path), "--prompt-file", str(file)]
    assert main([*argv, "--set", "parallel.tensor_parallel_size=2"]) == 2
    err = capsys.readouterr().err
    assert "parallel.tensor_parallel_size 2" in err and "--engine ray" in err


def test_a_real_models_corrupt_cpu_chunks_are_caught_and_recomputed(tmp_path: Path) -> None:
    """Real KV has no expected bytes: the ranks' checksums catch what ``corrupt-cpu`` flips,
    the loads fail, their requests recompute, and every token is the fault-free one."""
    path, _ = checkpoint(tmp_path / "ckpt", "qwen3-norms-sliding")
    reports = []
    for extra in ([], ["--fault", "corrupt-cpu:rate=0.5:seed=3"]):
        out = tmp_path / f"report{len(reports)}.json"
        argv = ["run", "--engine", "local", "--config", "configs/synthetic.yaml"]
        argv += ["--model", str(path), "--num-requests", "12", "--json-report", str(out)]
        argv += ["--verify", *extra]
        for s in ("parallel.tensor_parallel_size=1", "cache.num_gpu_blocks=64", *SMALL_CHAT):
            argv += ["--set", s]
        assert main(argv) == 0
        reports.append(json.loads(out.read_text()))
    clean, corrupt = reports
    assert clean["integrity"]["checked"] > 0 and clean["integrity"]["corrupt_detected"] == 0
    assert corrupt["integrity"]["corrupt_detected"] > 0
    assert corrupt["requests_finished"] == 12
    assert corrupt["output_digest"] == clean["output_digest"]


def generate_through_the_shared_tier(
    tmp_path: Path, engine: str, store: list[str]
) -> tuple[dict, list[int]]:
    """Two ``raykv generate`` runs (two engines, each with a CPU tier of its own) over one
    shared tier: the first computes a prompt, the second loads its prefix from the store.
    The second run's JSON, and its prompt."""
    path, model = checkpoint(tmp_path / "ckpt", "llama-llama3-untied")
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(1, SHAPE["vocab_size"], (32,), generator=gen).tolist()
    sets = [
        "cache.block_size=4",
        "offload.cpu_slots=64",
        "offload.take_hits=always",  # the loaded request is the point, not the choice
        *store,
    ]
    results = []
    for n, prompt in enumerate(([*shared, 3], [*shared, 4, 5])):
        file, out = tmp_path / f"prompt{n}.jsonl", tmp_path / f"out{n}.json"
        file.write_text(json.dumps({"prompt_token_ids": prompt}) + "\n")
        argv = ["generate", "--model", str(path), "--prompt-file", str(file), "--engine", engine]
        argv += ["--max-tokens", "5", "--json", str(out), "--logprobs", "2"]
        for s in sets:
            argv += ["--set", s]
        assert main(argv) == 0
        results.append(json.loads(out.read_text()))
    assert_matches_transformers(model, [*shared, 4, 5], results[1]["outputs"][0], top=2)
    return results[1], [*shared, 4, 5]


def test_a_prompt_loaded_from_the_shared_tier_has_transformers_logprobs(
    tmp_path: Path, shared_store: str
) -> None:
    store = [
        "offload.shared.enabled=true",
        f"offload.shared.master={shared_store}",
        "offload.shared.mount=false",  # the session's segment: it outlives the engines
        "offload.shared.segment=64MiB",
    ]
    second, prompt = generate_through_the_shared_tier(tmp_path, "local", store)
    assert second["report"]["shared_hit_tokens"] >= 28  # 7 of the 8 full blocks of 4 tokens
    assert second["report"]["shared_hit_tokens"] < len(prompt)


def generate_twice_on_one_disk_path(
    tmp_path: Path, name: str, *more: str, engine: str = "local", second: tuple[str, ...] = ()
) -> dict:
    """``raykv generate`` of one prompt, then again by a fresh engine on the same disk path:
    the second is answered with every full chunk of the prompt from the disk tier (the first
    one's stop spilled its CPU tier there), and gives transformers' tokens."""
    path, model = checkpoint(tmp_path / "ckpt", name)
    gen = torch.Generator().manual_seed(5)
    prompt_ids = torch.randint(1, SHAPE["vocab_size"], (41,), generator=gen).tolist()
    file = tmp_path / "prompt.jsonl"
    file.write_text(json.dumps({"prompt_token_ids": prompt_ids}) + "\n")
    # a CPU tier that holds the prompt's 10 chunks, and little more: the whole hit needs
    # slots the disk tier's demotions otherwise keep free (it was refused: 0 tokens loaded)
    sets = ["cache.block_size=4", "offload.cpu_slots=16", "offload.take_hits=always"]
    sets += ["offload.disk.enabled=true", f"offload.disk.path={tmp_path / 'disk'}", *more]
    reports = []
    for run in ("first", "second"):
        out = tmp_path / f"{run}.json"
        argv = ["generate", "--model", str(path), "--prompt-file", str(file), "--json", str(out)]
        argv += ["--max-tokens", "3", "--logprobs", "1", "--engine", engine]
        for s in [*sets, *(second if run == "second" else ())]:
            argv += ["--set", s]
        assert main(argv) == 0
        result = json.loads(out.read_text())
        assert_matches_transformers(model, prompt_ids, result["outputs"][0], top=1)
        reports.append(result["report"])
    first, second = reports
    assert first["disk_hit_tokens"] == 0
    assert second["tiers"]["disk"]["warm_start_chunks"] >= 10
    assert second["disk_hit_tokens"] == 40  # every full chunk; the last token is computed
    return second


def test_a_second_generate_on_a_disk_path_loads_every_full_chunk_from_disk(
    tmp_path: Path,
) -> None:
    """Found by a new user: the second run found 42 chunks at its warm start and loaded none
    (an idle engine's wait was counted in steps; the promotion was refused for the reserve)."""
    generate_twice_on_one_disk_path(tmp_path, "llama-tied")


def test_an_idle_engine_waits_for_a_slow_disk_without_declaring_its_rank_dead(
    tmp_path: Path,
) -> None:
    """Found with slow-disk:ms=800: the promotion's job went unacked for 256 (idle, quick)
    steps, its rank was declared dead and replaced, and the request recomputed. A move between
    the tiers counts against its rank only once it is old by the clock too."""
    second = generate_twice_on_one_disk_path(
        tmp_path, "llama-tied", second=('faults=["slow-disk:ms=600"]',)
    )
    assert second["rank_restarts"] == 0


def test_a_cpu_tier_smaller_than_one_chunk_of_the_model_is_refused_naming_the_key(
    tmp_path: Path, capsys
) -> None:
    """Found by an audit: a size below one chunk was rounded up to one slot; and the check
    used the synthetic model's chunk, not the checkpoint's (12 KiB here: 3 layers, 2 KV heads of
    16, 16 tokens, float32)."""
    path, _ = checkpoint(tmp_path / "ckpt", "llama-tied")
    file = tmp_path / "x.jsonl"
    file.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    argv = ["generate", "--model", str(path), "--prompt-file", str(file), "--max-tokens", "1"]
    assert main([*argv, "--set", "offload.cpu_bytes=8KiB"]) == 2
    err = capsys.readouterr().err
    assert "offload.cpu_bytes (8192) is smaller than one chunk of the model (12288 bytes" in err
    assert err.count("raykv: error") == 1 and "Traceback" not in err
    assert main([*argv, "--set", "offload.cpu_bytes=32KiB"]) == 0  # two chunks: taken
