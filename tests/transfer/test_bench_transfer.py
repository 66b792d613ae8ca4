"""The transfer bench returns its documented shape (no timing assertions: CI machines are noisy)."""

from __future__ import annotations

import pytest
import torch

from raykv.bench.transfer import bench_layout, format_transfer_table, run_transfer_bench


@pytest.mark.parametrize("pattern", ["random", "contiguous"])
def test_bench_shape(pattern: str) -> None:
    result = run_transfer_bench("cpu", [4, 16], 8, ["store", "load", "both"], pattern, repeat=1)
    assert result["device"] == "cpu"
    assert result["pattern"] == pattern
    rows = result["results"]
    assert [(r["page_kib"], r["direction"]) for r in rows] == [
        (k, d) for k in (4, 16) for d in ("store", "load", "both")
    ]
    for row in rows:
        assert row["blocks"] == 8
        assert row["bytes"] == 8 * row["page_kib"] * 1024
        assert row["gbps"] > 0 and row["baseline_gbps"] > 0
        assert row["ratio"] == pytest.approx(row["gbps"] / row["baseline_gbps"])
    table = format_transfer_table(result)
    assert "store" in table and "both" in table
    assert len(table.splitlines()) == 2 + len(rows)


def test_bench_caps_memory() -> None:
    result = run_transfer_bench("cpu", [64], 64, ["store"], repeat=1, max_bytes=1 << 20)
    assert result["results"][0]["blocks"] == 8  # 1 MiB / (kv + pool of 64 KiB pages)


@pytest.mark.parametrize("kib", [4, 6, 64, 256])
def test_bench_layout_page_size(kib: int) -> None:
    lay = bench_layout(kib, 4)
    assert lay.page_bytes == kib * 1024
    assert lay.dtype == "float16" and lay.blocks_per_chunk == 1 and lay.num_slots == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_bench_on_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        run_transfer_bench("cuda", [4], 8, ["store"])


def test_bench_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="direction"):
        run_transfer_bench("cpu", [4], 8, ["sideways"])
    with pytest.raises(ValueError, match="pattern"):
        run_transfer_bench("cpu", [4], 8, ["store"], pattern="zigzag")
    with pytest.raises(ValueError, match="device"):
        run_transfer_bench("tpu", [4], 8, ["store"])


def test_bench_of_pages_in_pieces_moves_the_same_bytes() -> None:
    """``--pieces``: a page split into per-layer byte views (vLLM's canonical views), through
    the same engine raykv's worker inside vLLM copies with."""
    result = run_transfer_bench("cpu", [8], 8, ["store", "load", "both"], repeat=1, pieces=4)
    assert result["pieces"] == 4
    for row in result["results"]:
        assert row["pieces"] == 4 and row["bytes"] == 8 * 8 * 1024
        assert row["gbps"] > 0 and row["baseline_gbps"] > 0
    assert "4 pieces" in format_transfer_table(result)
    with pytest.raises(ValueError, match="does not split into 3 equal pieces"):
        run_transfer_bench("cpu", [8], 8, ["store"], pieces=3)
