"""``raykv bench transfer`` and ``raykv bench step`` through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raykv.cli import main


def test_bench_transfer_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "transfer.json"
    argv = ["bench", "transfer", "--device", "cpu", "--page-kib", "16", "--blocks", "8"]
    assert main([*argv, "--repeat", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["pattern"] == "random"
    rows = result["results"]
    assert [(r["page_kib"], r["direction"]) for r in rows] == [
        (16, "store"),
        (16, "load"),
        (16, "both"),
    ]
    for row in rows:
        assert {"gbps", "baseline_gbps", "ratio", "blocks", "bytes"} <= set(row)
        assert row["gbps"] > 0 and row["baseline_gbps"] > 0
    assert "copy_ GB/s" in capsys.readouterr().out


def test_bench_transfer_one_direction(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    argv = ["bench", "transfer", "--page-kib", "4,16", "--blocks", "4", "--direction", "load"]
    assert main([*argv, "--pattern", "contiguous", "--repeat", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["pattern"] == "contiguous"
    assert [(r["page_kib"], r["direction"]) for r in result["results"]] == [
        (4, "load"),
        (16, "load"),
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_bench_transfer_cuda_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "transfer", "--device", "cuda", "--page-kib", "16"]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and "--device cpu" in err


def test_bench_transfer_bad_direction(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "transfer", "--page-kib", "16", "--blocks", "4", "--direction", "up"]
    assert main(argv) == 2
    assert "direction must be one of" in capsys.readouterr().err


def test_bench_transfer_pieces_that_do_not_split_a_page(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "transfer", "--page-kib", "16", "--blocks", "4", "--pieces", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--pieces 3" in err and "16 KiB" in err and "Traceback" not in err
    assert main(["bench", "transfer", "--device", "disk", "--pieces", "2"]) == 2
    assert "--pieces: only with --device cpu or cuda" in capsys.readouterr().err


def test_bench_step_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "step.json"
    argv = ["bench", "step", "--cached", "64,300", "--steps", "20", "--repeat", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["cached"]) == {"64", "300"}
    for row in result["cached"].values():
        assert row["us_per_step"] > 0 and row["mean_us"] > 0
    assert result["ratio"] > 0 and result["policy"] == "lru"
    assert isinstance(result["within_limit"], bool) and result["same_work"] is True
    assert "ratio" in capsys.readouterr().out


def test_bench_step_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "step", "--policy", "nope", "--steps", "5", "--repeat", "1"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert main(["bench", "step", "--cached", "8", "--steps", "5", "--repeat", "1"]) == 2
    assert "cached counts must be" in capsys.readouterr().err


def test_bench_plan_a_decode_step_weighs_the_batch_not_its_contexts(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    argv = ["bench", "plan", "--requests", "8", "--context", "256,2048", "--steps", "20"]
    assert main([*argv, "--json", str(out)]) == 0
    short, long = json.loads(out.read_text())["results"]
    assert (short["context"], long["context"]) == (256, 2048) and short["steps"] == 19
    # whole tables grow with the context (8x the blocks); the changes do not: a decode step
    # sends at most one new block per request, and every step sends the same number of tokens
    assert long["whole"]["plan_bytes"] > 6 * short["whole"]["plan_bytes"]
    assert long["changes"]["plan_bytes"] <= 1.1 * short["changes"]["plan_bytes"]
    assert long["changes"]["plan_bytes"] < long["whole"]["plan_bytes"] / 10
    assert long["bytes_ratio"] == long["changes"]["plan_bytes"] / long["whole"]["plan_bytes"]
    for row in (short, long):
        for form in ("changes", "whole"):
            assert row[form]["scheduler_us"] > 0 and row[form]["rank_us"] > 0


def test_bench_plan_holds_as_many_steps_as_asked(tmp_path: Path) -> None:
    # 150 decode steps outgrow the prompt's blocks by ten per request: the pool must hold them
    out = tmp_path / "plan.json"
    argv = ["bench", "plan", "--requests", "3", "--context", "100", "--steps", "150"]
    assert main([*argv, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["steps"] == 149


def test_bench_plan_a_real_models_plans_carry_no_parent_hashes(tmp_path: Path) -> None:
    sizes = {}
    for flag in ([], ["--real-model"]):
        out = tmp_path / f"plan{len(flag)}.json"
        argv = ["bench", "plan", "--requests", "4", "--context", "64", "--steps", "3"]
        assert main([*argv, *flag, "--json", str(out)]) == 0
        sizes[bool(flag)] = json.loads(out.read_text())["results"][0]["changes"]["plan_bytes"]
    # one 64-bit parent hash (9 bytes of MessagePack) per request less
    assert sizes[False] - sizes[True] >= 4 * 9


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--requests", "0"], "argument --requests: expected positive integers, got '0'"),
        (["--context", "4,0"], "argument --context: expected positive integers, got '4,0'"),
        (["--steps", "1"], "--steps must be >= 2 and --groups >= 1 (got 1, 1)"),
    ],
)
def test_bench_plan_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["bench", "plan", *argv])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err
