"""``raykv bench vllm`` end to end on a tiny model: every way runs, every loaded run was loaded
from the tier it names, and the report has the rows the issue asks for."""

from __future__ import annotations

import json

import pytest

from raykv.cli.main import main

BLOCK = 32


def test_bench_reports_each_tier_loaded(vllm_model, tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "vllm",
            "--model",
            str(vllm_model),
            "--prompt-tokens",
            "200",
            "--repeat",
            "1",
            "--block-tokens",
            str(BLOCK),
            "--throughput-requests",
            "2",
            "--throughput-prompt-tokens",
            "64",
            "--throughput-output-tokens",
            "4",
            "--throughput-rounds",
            "2",
            "--enforce-eager",  # eight engines start: each 7 s sooner
            "--slow-disk-ms",
            "50",
            "--disk-path",
            str(tmp_path),
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    whole_blocks = 199 // BLOCK * BLOCK  # a lookup never covers the last token
    assert row["prompt_tokens"] == 200
    assert row["cpu_hit_tokens"] == row["disk_hit_tokens"] == whole_blocks
    assert row["shared_hit_tokens"] == whole_blocks
    for tier in ("cpu", "disk", "shared"):
        assert row[f"{tier}_tier_s"] > 0, tier
        # a loaded run's load job is part of its first token's time
        assert 0 < row[f"{tier}_load_s"] < row[f"{tier}_tier_s"], tier
    assert row["recompute_s"] > 0
    assert row["disk_limit_s"] > row["limit_s"] > 0 and row["shared_limit_s"] > row["limit_s"]
    config = json.loads((vllm_model / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    head_bytes = head_dim * 4  # float32
    per_token = 2 * config["num_hidden_layers"] * heads * head_bytes  # K and V of every layer
    assert row["kv_bytes"] == whole_blocks * per_token
    throughput = report["throughput"]
    assert throughput["ratio"] > 0 and throughput["shared_ratio"] > 0
    assert len(throughput["ratios"]) == len(throughput["shared_ratios"]) == 2
    assert throughput["shared_pool_cpu_s"] >= 0  # read from the pool's process
    slow = report["slow_disk_restart"]
    (request,) = slow["requests"]  # one prompt: loaded, as nothing is priced yet
    assert slow["disk_ms"] == 50 and request["prompt_tokens"] == 200
    assert request["loaded_tokens"] == whole_blocks and request["ratio"] > 0
    printed = capsys.readouterr().out
    assert "CPU tier" in printed and "shared tier" in printed
    assert "warm restart from a disk at 50 ms a load" in printed
    assert list(tmp_path.iterdir()) == [out]  # the run's files are gone


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (["--model", "nothing"], "--model"),
        (["--prompt-tokens", "32", "--block-tokens", "32"], "--prompt-tokens"),
        (["--prompt-tokens", "256,256"], "--prompt-tokens"),
        (["--block-tokens", "48"], "--block-tokens"),
    ],
    ids=["no-model", "no-whole-block", "twice", "block-size"],
)
def test_bench_refuses_what_it_cannot_measure(vllm_model, arguments, named, capsys) -> None:
    code = main(["bench", "vllm", "--model", str(vllm_model), *arguments])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and named in err[0]
