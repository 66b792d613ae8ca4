"""``raykv bench ttft`` on a tiny checkpoint: the JSON has every field, both ways really ran
(the second run of each prompt found it in the CPU tier), transformers' forward pass was timed
beside them, and the plot is a PNG. Speed is not asserted: the benchmark reports it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from raykv.cli import main
from tests.model.test_decoder import checkpoint

FIELDS = {"prompt_tokens", "recompute_s", "cpu_tier_s", "speedup", "transformers_s"}


def run_bench(tmp_path: Path, *extra: str) -> dict:
    path, _ = checkpoint(tmp_path / "ckpt", "llama-tied")
    out, plot = tmp_path / "ttft.json", tmp_path / "ttft.png"
    argv = ["bench", "ttft", "--model", str(path), "--prompt-tokens", "24,64", "--repeat", "2"]
    argv += ["--json", str(out), "--plot", str(plot), "--set", "cache.block_size=4", *extra]
    assert main(argv) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(out.read_text())


def check(result: dict) -> None:
    assert result["model"].endswith("ckpt") and result["device"] == "cpu"
    assert [r["prompt_tokens"] for r in result["results"]] == [24, 64]
    for r in result["results"]:
        assert set(r) >= FIELDS
        assert r["recompute_s"] > 0 and r["cpu_tier_s"] > 0 and r["transformers_s"] > 0
        assert r["speedup"] == pytest.approx(r["recompute_s"] / r["cpu_tier_s"])
        # loaded: every block of the prompt but the one holding its last token
        assert r["cpu_hit_tokens"] == (r["prompt_tokens"] - 1) // 4 * 4
        if r["disk_tier_s"] is not None:  # a fresh engine on the disk path finds all of them
            assert r["restart_s"] > 0 and r["restart_speedup"] > 0
            assert r["restart_hit_tokens"] == (r["prompt_tokens"] - 1) // 4 * 4


def test_bench_ttft_measures_both_ways_and_transformers(tmp_path: Path) -> None:
    result = run_bench(tmp_path)
    assert result["engine"] == "local" and result["tensor_parallel_size"] == 1
    check(result)


def test_bench_ttft_refuses_a_prompt_longer_than_the_context(tmp_path: Path, capsys) -> None:
    path, _ = checkpoint(tmp_path / "ckpt", "llama-tied")  # a context of 256
    argv = ["bench", "ttft", "--model", str(path), "--prompt-tokens", "64,512"]
    assert main(argv) == 2
    assert "--prompt-tokens 512: longer than the model's context of 256" in capsys.readouterr().err


def offload_argv(tmp_path: Path, requests: int, out: Path) -> list[str]:
    """``raykv bench offload`` on the local engine as test_generate's ``raykv run``: a tiny
    checkpoint with two KV groups in a small pool, so that the chat reaches the tier."""
    from tests.model.test_generate import SMALL_CHAT

    path, _ = checkpoint(tmp_path / "ckpt", "qwen3-norms-sliding")
    argv = ["bench", "offload", "--engine", "local", "--config", "configs/synthetic.yaml"]
    argv += ["--model", str(path), "--num-requests", str(requests), "--json", str(out)]
    for s in ("parallel.tensor_parallel_size=1", "cache.num_gpu_blocks=64", *SMALL_CHAT):
        argv += ["--set", s]
    return argv


def test_bench_offload_runs_the_workload_both_ways_and_joins_them_by_request(
    tmp_path: Path,
) -> None:
    out, plot = tmp_path / "offload.json", tmp_path / "offload.png"
    argv = [*offload_argv(tmp_path, 12, out), "--plot", str(plot)]
    assert main(argv) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(out.read_text())
    on, off = result["runs"]["with_tier"], result["runs"]["without_tier"]
    assert on["config"]["offload"]["enabled"] and not off["config"]["offload"]["enabled"]
    assert on["cpu_hit_tokens"] > 0 and off["cpu_hit_tokens"] == 0
    assert on["output_digest"] == off["output_digest"]  # the same tokens either way
    assert len(on["requests"]) == len(off["requests"]) == 12
    assert result["with_tier"]["prefill_tokens"] == on["prefill_tokens"]
    hit = [r["req_id"] for r in on["requests"] if r["cpu_hit_tokens"] > 0]
    assert result["cpu_hit_requests"]["count"] == len(hit) > 0
    ratio = result["cpu_hit_requests"]["ttft_ratio_median"]
    assert ratio is not None and ratio > 0
    assert result["ratios"]["ttft_mean"] == pytest.approx(
        on["ttft_s"]["mean"] / off["ttft_s"]["mean"]
    )
    assert result["warm_up_requests"] == 12  # the whole workload, by default
    # the step's time split into the rank's model and the rest of its work (its moves)
    step = on["step_time"]
    assert step["model_s"] > 0 and step["transfers_s"] >= 0
    assert step["model_s"] + step["transfers_s"] == pytest.approx(step["ranks_busy_s"])
    assert result["with_tier"]["step_time"]["model_s"] == step["model_s"]


def test_the_offload_bench_warm_up_is_the_workload_on_the_local_engine_unless_asked() -> None:
    from raykv.bench.offload import warm_up_requests

    assert warm_up_requests(300) == 300 and warm_up_requests(300, "ray") == 0
    assert warm_up_requests(300, asked=0) == 0 and warm_up_requests(300, "ray", asked=8) == 8
    assert warm_up_requests(300, asked=500) == 300 and warm_up_requests(300, asked=40) == 40


def test_bench_offload_refuses_a_negative_warm_up(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "offload", "--warm-up", "-5"])
    assert exit_info.value.code == 2
    assert "--warm-up: expected 0 or a positive integer, got '-5'" in capsys.readouterr().err


def test_bench_offload_repeats_pool_each_way_and_give_each_disk_tier_its_own_start(
    tmp_path: Path,
) -> None:
    from raykv.engine.latency import percentile

    out, disk = tmp_path / "offload.json", tmp_path / "disk"
    argv = [*offload_argv(tmp_path, 6, out), "--repeat", "2", "--tiers", "cpu,disk"]
    argv += ["--disk-path", str(disk), "--warm-up", "0"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["repeats"] == 2 and result["warm_up_requests"] == 0
    on = result["runs"]["with_tier"]
    ids = [r["req_id"] for r in on["requests"]]
    assert len(ids) == 12 and len(set(ids)) == 12
    assert {i.rsplit("#", 1)[1] for i in ids} == {"0", "1"}
    ttfts = sorted(r["ttft_s"] for r in on["requests"])
    assert result["with_tier"]["ttft_p90_s"] == pytest.approx(percentile(ttfts, 90))
    # each repeat's own ratios beside the pooled ones: their scatter is the run-to-run noise
    spread = result["repeat_ratios"]
    assert set(spread) == set(result["ratios"])
    assert all(len(v) == 2 and all(r > 0 for r in v) for v in spread.values())
    # the second repeat's disk tier is a directory of its own: it starts as empty as the first's
    assert any((disk / "repeat-1").iterdir())


def test_pooled_repeats_weigh_each_runs_step_time_by_its_steps() -> None:
    from raykv.bench.offload import pool_runs

    def report(steps: int, step_s: float, model_s: float, busy: float) -> dict:
        return {
            "requests": [{"req_id": "r", "ttft_s": step_s}],
            "throughput": {"generated_tokens_per_s": 1.0, "prompt_tokens_per_s": 1.0},
            "prefill_tokens": {"computed": 10},
            "steps": steps,
            "idle_steps": steps // 2,
            "step_time": {
                "step_s": step_s,
                "busy_step_s": 2 * step_s,
                "ranks_busy_s": busy,
                "model_s": model_s,
                "transfers_s": 0.1,
                "outside_share": 1 - busy / step_s,
            },
            "wall_seconds": steps * step_s,
            "requests_finished": 1,
            "cpu_hit_tokens": 0,
        }

    pooled = pool_runs([report(10, 1.0, 0.5, 0.5), report(30, 2.0, 1.5, 1.8)])["step_time"]
    # every step counts once: (10 * 1.0 + 30 * 2.0) / 40, not the mean of the two runs' means
    assert pooled["step_s"] == pytest.approx(1.75)
    assert pooled["model_s"] == pytest.approx((10 * 0.5 + 30 * 1.5) / 40)
    assert pooled["transfers_s"] == pytest.approx(0.1)
    # a busy step's mean over the busy steps (5 and 15 of them)
    assert pooled["busy_step_s"] == pytest.approx((5 * 2.0 + 15 * 4.0) / 20)
    # the share outside the ranks from the pooled means, not a mean of the two shares
    busy = (10 * 0.5 + 30 * 1.8) / 40
    assert pooled["outside_share"] == pytest.approx(1 - busy / 1.75)
