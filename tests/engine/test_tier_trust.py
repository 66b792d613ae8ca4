"""The disk tier as a trust boundary, in one process with the synthetic model (every output token
depends on every KV byte it read): a file of another rank or another namespace put in place of a
chunk's file, or a special file (a FIFO, a directory, a link), is never served and never hangs a
rank; the outputs are those of the run without any tier."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from raykv.config import load_config
from raykv.engine.tier_namespace import disk_rank_root
from tests.engine.test_disk_tier import SMALL, disk, run


@pytest.fixture(scope="module")
def baseline() -> str:
    report, _ = run(SMALL, offload=False)
    return report["output_digest"]


def rank_files(sets: list[str], rank: int) -> dict[str, Path]:
    """A rank's chunk files by name (the key), below its directory of the namespace."""
    root = Path(disk_rank_root(load_config(None, sets), rank))
    return {p.name: p for p in root.rglob("*.kv")}


def test_a_file_of_another_rank_in_place_of_a_chunk_is_never_served(
    baseline: str, disk_dir: str
) -> None:
    """Each rank holds its own heads of a chunk: rank 1's file copied over rank 0's of the same
    key has the same key, geometry and checksums. It passed every check (12 mismatches, a wrong
    digest) before the header named the rank."""
    sets = SMALL + disk(disk_dir)
    run(sets)
    zero, one = rank_files(sets, 0), rank_files(sets, 1)
    both = sorted(set(zero) & set(one))
    assert len(both) > 8
    for name in both:
        shutil.copyfile(one[name], zero[name])
    report, books = run(sets)
    assert report["output_digest"] == baseline
    assert report["integrity"]["mismatches"] == 0
    d = report["tiers"]["disk"]
    # refused where read: counted corrupt, never loaded
    assert d["warm_start_chunks"] > 0 and d["corrupt"] > 0
    assert not any(books.values()), books


@pytest.mark.timeout(120)
def test_special_files_under_chunks_names_are_taken_away_and_never_hang_a_run(
    baseline: str, disk_dir: str
) -> None:
    """A FIFO in place of a chunk's file hung every disk I/O thread (and the rank's recovery
    after it); a directory was recycled into ``free/`` and failed the demotions that picked
    it, across restarts. Each kind, planted between two runs, is taken away at the warm start."""
    from tests.transfer.test_disk_engine import SPECIAL, _plant

    sets = SMALL + disk(disk_dir)
    run(sets)
    files = sorted(rank_files(sets, 0).values())
    assert len(files) > 2 * len(SPECIAL)
    real = files[-1]
    for path, what in zip(files, SPECIAL * 2, strict=False):
        _plant(str(path), what, str(real))
    report, books = run(sets)
    assert report["output_digest"] == baseline
    assert report["integrity"]["mismatches"] == 0
    d = report["tiers"]["disk"]
    assert d["special_files"] >= 2 * len(SPECIAL), d
    assert d["demotions_failed"] == 0 and d["warm_start_chunks"] > 0
    root = Path(disk_rank_root(load_config(None, sets), 0))
    left = [
        p
        for p in root.rglob("*")
        if not (p.is_file() and not p.is_symlink()) and p.is_dir() is False
    ]
    assert not left, left
    assert not any(books.values()), books


def test_one_bad_file_costs_its_own_chunk_not_its_whole_promotion(
    baseline: str, disk_dir: str
) -> None:
    """A promotion reads up to 64 chunks; a rank that found one file bad failed the job, and
    every chunk of it was counted corrupt and deleted on every rank (30 tampered files were
    reported as 44, 62 or 64). Ranks now name the keys they found bad."""
    sets = SMALL + disk(disk_dir)
    run(sets)
    files = sorted(rank_files(sets, 1).values())
    tampered = files[::3]
    for path in tampered:
        with open(path, "r+b") as fh:
            fh.seek(4096 + 17)  # a byte of the first page (the header is 4 KiB)
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0xFF]))
    report, books = run(sets)
    assert report["output_digest"] == baseline
    d = report["tiers"]["disk"]
    assert 0 < d["corrupt"] <= len(tampered), (d["corrupt"], len(tampered))
    assert d["promotions_failed"] > d["corrupt"]  # the failed jobs' other chunks stayed
    assert not any(books.values()), books


def test_the_end_of_a_run_spills_the_cpu_tier_and_the_next_run_starts_warm(
    disk_dir: str, tmp_path
) -> None:
    """A graceful stop of ``raykv run`` wrote none of the CPU tier to the disk tier (only the
    benches spilled): a CPU tier that never filled left the disk empty, and the next run cold."""
    import json

    from raykv.cli import main

    def run_cli(name: str, path: str, *more: str) -> dict:
        out = tmp_path / f"{name}.json"
        argv = ["run", "--engine", "local", "--config", "configs/synthetic.yaml"]
        argv += ["--num-requests", "12", "--json-report", str(out)]
        for s in [*disk(path), "offload.cpu_slots=512", *more]:
            argv += ["--set", s]
        assert main(argv) == 0
        return json.loads(out.read_text())

    first = run_cli("first", disk_dir)
    assert first["tiers"]["disk"]["demoted_chunks"] == 0  # a CPU tier that never filled
    second = run_cli("second", disk_dir)
    assert second["tiers"]["disk"]["warm_start_chunks"] >= first["tiers"]["cpu"]["used_chunks"] > 0
    assert second["disk_hit_tokens"] > 0
    # offload.disk.spill_on_stop_s=0: nothing at the stop, as before
    other = str(tmp_path / "no-spill")
    run_cli("no spill", other, "offload.disk.spill_on_stop_s=0")
    assert run_cli("after no spill", other)["tiers"]["disk"]["warm_start_chunks"] == 0


def test_a_rank_whose_disk_read_never_returns_is_replaced_on_a_fresh_pool(
    disk_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's recovery waits for its I/O threads a bounded time; a read left behind may land
    in its CPU slot whenever its system call returns, checksum and all, so the replacement must
    not take that pool over (it did: found by review). The hang is forced with a read that
    waits on an event (a real file system cannot hang on demand)."""
    import raykv.transfer.chunk_jobs as chunk_jobs
    from raykv.core.step import TierMove
    from raykv.engine.workers import LocalWorkerGroup
    from tests.transfer.test_disk_engine import hang_reads

    monkeypatch.setattr(chunk_jobs, "SHUTDOWN_WAIT_S", 0.3)
    cfg = load_config(None, SMALL + disk(disk_dir))
    with LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers:
        rank = workers.workers[1]
        before = rank.shared.path
        engine = rank.disk  # no fault wraps it here
        entered, release = hang_reads(engine)
        engine.submit(TierMove.of(7, True, [0x1234 << 8], [0], False))
        assert entered.wait(10)
        try:
            assert workers.restart([1]) is False  # the CPU tier cannot be kept
            after = workers.workers[1]
            assert not after.pool_attached and after.shared.path != before
            # a later death with nothing left behind takes the fresh pool over
            assert workers.restart([1]) is True
            assert workers.workers[1].shared.path == after.shared.path
        finally:
            release.set()
