"""``raykv bench transfer --device disk`` on a few MiB in a temporary directory: its rows, its
modes, the files it leaves (none, on an error too) and the paths it refuses. No timing asserted
beyond "positive": this machine's disk is noisy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raykv.bench import disk_transfer
from raykv.bench.disk_transfer import format_disk_table, run_disk_bench
from raykv.bench.transfer import best_pair
from raykv.cli import main
from raykv.transfer.disk import probe_direct_io


def _leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_rows_of_both_directions_and_modes(tmp_path: Path) -> None:
    # 64 KiB pages fit O_DIRECT's 4 KiB alignment; 6 KiB pages do not (a bounce buffer then)
    result = run_disk_bench([64, 6], 32, ["store", "load"], repeat=1, path=str(tmp_path))
    direct = probe_direct_io(str(tmp_path))
    assert result["device"] == "disk" and result["direct_io"] is direct
    rows = result["results"]
    assert [(r["page_kib"], r["mode"], r["direction"]) for r in rows] == [
        (kib, mode, direction)
        for kib in (64, 6)
        for mode in ("cold", "warm")
        for direction in ("store", "load")
    ]
    for row in rows:
        assert row["blocks"] == row["chunks"] == 32 and row["blocks_per_chunk"] == 1
        assert row["bytes"] == 32 * row["page_kib"] * 1024
        assert row["gbps"] > 0 and row["baseline_gbps"] > 0
        assert row["ratio"] == pytest.approx(row["gbps"] / row["baseline_gbps"])
        cold_direct = row["mode"] == "cold" and direct
        assert row["io"] == ("direct" if cold_direct else "buffered")
        assert row["cache"] == ("bypassed" if cold_direct else "kept")
        # the pool is page-aligned: only rows O_DIRECT cannot take whole need a bounce buffer
        assert row["zero_copy"] is not (cold_direct and row["page_kib"] == 6)
    table = format_disk_table(result)
    assert len(table.splitlines()) == 2 + len(rows) and "plain GB/s" in table
    assert _leftovers(tmp_path) == []


def test_chunks_of_several_blocks_and_the_size_cap(tmp_path: Path) -> None:
    result = run_disk_bench(
        [16], 64, ["load"], ["warm"], 1, str(tmp_path), blocks_per_chunk=4, max_bytes=2**19
    )
    (row,) = result["results"]
    # 512 KiB of 16 KiB pages: 32 blocks, 8 files of 4 pages
    assert (row["blocks"], row["chunks"], row["blocks_per_chunk"]) == (32, 8, 4)
    assert row["direction"] == "load" and row["gbps"] > 0
    assert _leftovers(tmp_path) == []


def test_cold_without_o_direct_drops_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_transfer, "probe_direct_io", lambda _path: False)
    result = run_disk_bench([64], 16, ["store", "load"], ["cold"], 1, str(tmp_path))
    assert result["direct_io"] is False and "FADV_DONTNEED" in result["cold_io"]
    for row in result["results"]:
        assert (row["mode"], row["io"], row["cache"]) == ("cold", "buffered", "dropped")
        assert row["gbps"] > 0 and row["baseline_gbps"] > 0
    assert _leftovers(tmp_path) == []


def test_a_failed_engine_job_is_an_error_and_leaves_no_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raykv.transfer.chunk_io import ChunkIO

    def broken_read(self: ChunkIO, key: int, slot: int, check: bool) -> None:
        raise OSError(5, "injected")

    monkeypatch.setattr(ChunkIO, "read", broken_read)
    with pytest.raises(RuntimeError, match="load of 8 chunks failed"):
        run_disk_bench([64], 8, ["store", "load"], ["warm"], 1, str(tmp_path))
    assert _leftovers(tmp_path) == []


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="direction must be one of"):
        run_disk_bench([64], 8, ["both"], path=str(tmp_path))
    with pytest.raises(ValueError, match="mode must be one of"):
        run_disk_bench([64], 8, ["load"], ["tepid"], path=str(tmp_path))
    with pytest.raises(ValueError, match="no such directory"):
        run_disk_bench([64], 8, ["load"], path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="multiple of blocks_per_chunk"):
        disk_transfer.disk_layout(64, 10, 4)


def test_best_pair_runs_before_each_run_untimed() -> None:
    calls: list[str] = []
    best_pair(
        lambda: calls.append("a"),
        lambda: calls.append("b"),
        2,
        before=lambda which: calls.append(f"before {which}"),
    )
    assert calls == ["before 0", "a", "before 1", "b"] * 3  # the untimed round, then 2


def test_cli_writes_disk_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "disk.json"
    files = tmp_path / "files"
    files.mkdir()
    argv = ["bench", "transfer", "--device", "disk", "--page-kib", "64", "--blocks", "16"]
    assert main([*argv, "--repeat", "1", "--path", str(files), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "disk" and result["path"] == str(files)
    assert {(r["mode"], r["direction"]) for r in result["results"]} == {
        (mode, direction) for mode in ("cold", "warm") for direction in ("store", "load")
    }
    assert "plain GB/s" in capsys.readouterr().out
    assert _leftovers(files) == []


@pytest.mark.parametrize("bad", ["missing", "a-file"])
def test_cli_refuses_a_bad_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    path = str(tmp_path / bad)
    assert main(["bench", "transfer", "--device", "disk", "--path", path]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--path {path}:" in err
    assert ("no such directory" if bad == "missing" else "not a directory") in err


def test_cli_disk_options_need_the_disk(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "transfer", "--device", "cpu", "--page-kib", "16", "--path", "/tmp"]
    assert main(argv) == 2
    assert "--path: only with --device disk" in capsys.readouterr().err
