"""``raykv bench vllm`` end to end on a tiny model: every way runs, every loaded run was loaded
from the tier it names, and the report has the rows the issue asks for."""

from __future__ import annotations

import json

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
    for key in ("recompute_s", "cpu_tier_s", "disk_tier_s", "limit_s", "disk_limit_s"):
        assert row[key] > 0, key
    assert row["shared_tier_s"] is None
    assert row["cpu_speedup"] == row["recompute_s"] / row["cpu_tier_s"]
    assert row["kv_bytes"] > 0 and row["kv_bytes"] % (whole_blocks // BLOCK) == 0
    assert report["throughput"]["ratio"] > 0
    assert "CPU tier" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [out]  # the run's files are gone


def test_bench_refuses_a_model_that_is_not_there(tmp_path, capsys) -> None:
    code = main(["bench", "vllm", "--model", str(tmp_path / "nothing")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "--model" in err[0]
