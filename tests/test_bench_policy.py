"""``raykv bench policy``: replay semantics, the reference rows, and the shipped-trace numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raykv.bench.policy import (
    BASELINE_LRU,
    BELADY,
    prepare_accesses,
    replay,
    run_policy_bench,
)
from raykv.cli import main
from raykv.workload.trace import TraceRequest, read_trace

B = 512


def req(ids: list[int], tokens: int | None = None) -> TraceRequest:
    return TraceRequest(0.0, tokens if tokens is not None else len(ids) * B, 1, tuple(ids))


def test_replay_counts_prefix_hits_and_stores_only_full_blocks() -> None:
    # request 2 repeats request 1's prefix; request 1's last block is partial, so never stored
    trace = [req([1, 2, 3], 2 * B + 100), req([1, 2, 3, 4], 3 * B + 10), req([1, 9])]
    accesses = prepare_accesses(trace)
    for name in ("lru", "arc", "recall", BASELINE_LRU, BELADY):
        r = replay(accesses, 100 * B, name)
        # hits: 0, then blocks 1,2 (3 was partial in request 1), then block 1
        assert r.block_hit_rate == pytest.approx(3 / 9), name
        hit_tokens = 0 + 2 * B + B
        assert r.token_hit_rate == pytest.approx(hit_tokens / (2 * B + 100 + 3 * B + 10 + 2 * B))


def test_belady_keeps_the_block_used_soonest() -> None:
    # capacity 2 blocks; A is reused last, B soon: LRU loses B, Belady keeps it
    trace = [req([10]), req([20]), req([30]), req([20]), req([10])]
    accesses = prepare_accesses(trace)
    lru = replay(accesses, 2 * B, BASELINE_LRU)
    best = replay(accesses, 2 * B, BELADY)
    assert lru.block_hit_rate == pytest.approx(1 / 5)  # only the final 10
    assert best.block_hit_rate == pytest.approx(2 / 5)  # 20 and 10 (30 bypassed)
    assert best.evictions == 0


def test_directory_lru_equals_the_bare_lru(mooncake_trace: Path) -> None:
    accesses = prepare_accesses(read_trace(mooncake_trace, limit=1500))
    for cap in (200_000, 1_000_000):
        a, b = replay(accesses, cap, "lru"), replay(accesses, cap, BASELINE_LRU)
        assert (a.token_hit_rate, a.block_hit_rate, a.evictions) == (
            b.token_hit_rate,
            b.block_hit_rate,
            b.evictions,
        )


@pytest.fixture(scope="module")
def shipped_report(mooncake_trace: Path):
    accesses = prepare_accesses(read_trace(mooncake_trace))
    return run_policy_bench(
        accesses, [1_000_000, 3_000_000, 10_000_000], ["lru", "arc", "recall"], repeat=1
    )


# The table in ../shared/traces/README.md.
@pytest.mark.parametrize(
    "capacity,lru,belady",
    [(1_000_000, 0.150, 0.383), (3_000_000, 0.321, 0.560), (10_000_000, 0.588, 0.650)],
)
def test_reproduces_the_trace_readme_table(shipped_report, capacity, lru, belady) -> None:
    row = shipped_report.rows[capacity]
    assert row["lru"].token_hit_rate == pytest.approx(lru, abs=0.0005)
    assert row[BASELINE_LRU].token_hit_rate == pytest.approx(lru, abs=0.0005)
    assert row[BELADY].token_hit_rate == pytest.approx(belady, abs=0.0005)


@pytest.mark.parametrize("capacity", [1_000_000, 3_000_000, 10_000_000])
def test_recall_is_at_least_as_good_as_lru_and_arc(shipped_report, capacity) -> None:
    row = shipped_report.rows[capacity]
    best_known = max(row["lru"].token_hit_rate, row["arc"].token_hit_rate)
    assert row["recall"].token_hit_rate >= best_known
    assert row["recall"].token_hit_rate <= row[BELADY].token_hit_rate


def test_report_json_shape(shipped_report) -> None:
    data = shipped_report.as_json()
    row = data["capacities"]["1000000"]
    assert set(row) == {"lru", "arc", "recall", BASELINE_LRU, BELADY}
    assert set(row["lru"]) >= {"token_hit_rate", "block_hit_rate", "seconds"}


def test_cli_bench_policy_writes_json(mooncake_trace: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "policy", "--trace", str(mooncake_trace), "--capacity-tokens", "200000"]
    argv += ["--policies", "all", "--limit", "300", "--repeat", "1", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    row = data["capacities"]["200000"]
    assert {"lru", "arc", "recall", "belady", "baseline_lru"} <= set(row)
    assert data["requests"] == 300
    printed = capsys.readouterr().out
    assert "belady" in printed and "x belady" in printed


def test_cli_rejects_unknown_policy_before_replaying(mooncake_trace: Path, capsys) -> None:
    argv = ["bench", "policy", "--trace", str(mooncake_trace), "--capacity-tokens", "1000"]
    assert main([*argv, "--policies", "lru,nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err


def test_cli_reports_bad_trace_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    argv = ["bench", "policy", "--trace", str(bad), "--capacity-tokens", "1000"]
    assert main(argv) == 2
    assert "t.jsonl:1: missing field 'output_length'" in capsys.readouterr().err


def test_cli_config_check(tmp_path: Path, capsys) -> None:
    good = tmp_path / "c.yaml"
    good.write_text("offload:\n  cpu_bytes: 2GiB\n")
    assert main(["config", "check", str(good)]) == 0
    assert "cpu_bytes: 2147483648" in capsys.readouterr().out
    bad = tmp_path / "b.yaml"
    bad.write_text("offload:\n  cpu_bytez: 2GiB\n")
    assert main(["config", "check", str(bad)]) == 2
    assert "offload.cpu_bytez: unknown key" in capsys.readouterr().err
