"""The disk tier end to end in one process: real files, real copies, the synthetic model whose
every output token depends on every KV byte it read. Whatever the disk does (fails, corrupts,
stalls, fills up, loses files behind raykv's back, or a rank dies mid-write), the outputs are
those of the run without any tier."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raykv.config import ConfigError, load_config
from raykv.engine.core import EngineCore
from raykv.engine.stats import drain_books
from raykv.engine.tier_namespace import disk_rank_root
from raykv.engine.workers import LocalWorkerGroup
from raykv.runs.driver import run_workload
from raykv.workload.requests import make_workload

SMALL = [
    "workload.num_requests=48",
    "workload.seed=3",
    "cache.num_gpu_blocks=48",
    "workload.system_prompt_tokens=96",
    "workload.user_tokens=24",
    "workload.answer_tokens=16",
    "workload.max_tokens=6",
    "workload.concurrent_conversations=8",
    "parallel.tensor_parallel_size=2",
    "model.head_dim=8",
    "offload.cpu_slots=24",  # far smaller than the conversations: the CPU tier churns
    "offload.take_hits=always",  # every hit loaded: the protocol, not the choice, is tested
]


def disk(path: str, *more: str) -> list[str]:
    return [
        "offload.disk.enabled=true",
        f"offload.disk.path={path}",
        "offload.disk.capacity=8MiB",
        *more,
    ]


def run(sets: list[str], offload: bool = True) -> tuple[dict, dict[str, int]]:
    cfg = load_config(None, sets)
    with LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers:
        engine = EngineCore(cfg, workers, offload=offload, verify=True)
        report = run_workload(engine, make_workload(cfg), check_invariants=True)
        books = drain_books(engine)
    return report, books


@pytest.fixture(scope="module")
def baseline() -> str:
    """The digest of the run without any tier."""
    report, _ = run(SMALL, offload=False)
    return report["output_digest"]


def tier_hits(report: dict) -> int:
    return report["cpu_hit_tokens"] + report["disk_hit_tokens"]


def test_the_disk_tier_serves_what_the_cpu_tier_evicted_and_changes_no_output(
    baseline: str, disk_dir: str
) -> None:
    cpu_only, _ = run(SMALL)
    report, books = run(SMALL + disk(disk_dir))
    assert report["output_digest"] == cpu_only["output_digest"] == baseline
    assert report["integrity"]["mismatches"] == 0 and report["integrity"]["blocks_verified"] > 0
    d = report["tiers"]["disk"]
    assert d["demoted_chunks"] > 0 and d["promoted_chunks"] > 0 and d["corrupt"] == 0
    assert report["disk_hit_tokens"] > 0
    # how many evicted chunks reach the disk before the CPU tier drops them depends on the disk
    # threads' pace (idle: 3-5x the CPU-only hits, under CI load 1.7-2x): more, not how much more
    assert tier_hits(report) > tier_hits(cpu_only)
    assert not any(books.values()), books  # jobs, fence, slots being read or written: drained


def test_a_warm_restart_hits_the_disk_from_its_first_requests(baseline: str, disk_dir: str) -> None:
    first, _ = run(SMALL + disk(disk_dir))
    again, _ = run(SMALL + disk(disk_dir))
    assert again["output_digest"] == first["output_digest"] == baseline
    assert again["tiers"]["disk"]["warm_start_chunks"] > 0
    early = again["requests"][:8]
    assert sum(r["disk_hit_tokens"] for r in early) > 0
    assert tier_hits(again) > tier_hits(first)


def _files(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*.kv")}


def test_another_tp_size_or_model_never_reads_another_namespace(disk_dir: str) -> None:
    run(SMALL + disk(disk_dir))
    before = _files(Path(disk_dir))
    for other in (["parallel.tensor_parallel_size=1"], ["model.head_dim=16"]):
        report, _ = run(SMALL + disk(disk_dir) + other)
        d = report["tiers"]["disk"]
        assert d["warm_start_chunks"] == 0 and d["corrupt"] == 0
        after = _files(Path(disk_dir))
        # the first run's files are all there, untouched
        assert {p: t for p, t in after.items() if p in before} == before
    namespaces = [p for p in Path(disk_dir).iterdir() if p.is_dir()]
    assert len(namespaces) == 3


def test_files_damaged_or_deleted_between_runs_are_recomputed(baseline: str, disk_dir: str) -> None:
    run(SMALL + disk(disk_dir))
    cfg = load_config(None, SMALL + disk(disk_dir))
    files = sorted(Path(disk_rank_root(cfg, 1)).rglob("*.kv"))
    assert len(files) > 12
    for i, path in enumerate(files):
        if i % 3 == 0:
            os.truncate(path, path.stat().st_size // 2)
        elif i % 3 == 1:
            path.unlink()
    report, books = run(SMALL + disk(disk_dir))
    assert report["output_digest"] == baseline
    assert report["integrity"]["mismatches"] == 0
    # the deleted ones are partial (rank 0 still has its part): dropped at the warm start; the
    # truncated ones fail their promotion as corrupt, or were never needed
    assert report["tiers"]["disk"]["warm_start_chunks"] <= len(files) - len(files) // 3
    assert not any(books.values())


@pytest.mark.parametrize(
    ("fault", "counter"),
    [
        # reads and writes fail alike; a busy machine may promote only a chunk or two, all of
        # which may succeed, where its scores of demotions never all do
        ("fail-disk:rate=0.3", "promotions_failed+demotions_failed"),
        ("corrupt-disk:rate=0.5", "corrupt"),
        ("slow-disk:ms=15", "promoted_chunks"),
        ("full-disk:after=20", "full_events"),
        ("fail-disk:rate=1", "unavailable_events"),
        ("kill-worker:step=40:rank=1", "demoted_chunks"),
    ],
)
def test_every_disk_fault_ends_in_the_fault_free_outputs(
    baseline: str, disk_dir: str, fault: str, counter: str
) -> None:
    report, books = run(SMALL + disk(disk_dir) + [f'faults=["{fault}"]'])
    assert report["output_digest"] == baseline
    assert report["integrity"]["mismatches"] == 0
    tier = report["tiers"]["disk"]
    assert sum(tier[name] for name in counter.split("+")) > 0, tier
    assert not any(books.values()), books


def test_a_full_disk_stops_demotions_and_the_run_goes_on(disk_dir: str) -> None:
    report, _ = run(SMALL + disk(disk_dir) + ['faults=["full-disk"]'])
    d = report["tiers"]["disk"]
    assert d["full_events"] >= 1 and d["demoted_chunks"] == 0
    # demotions paused after the first full write: one job, not one per step
    assert d["demotions"] == 1 and d["demotions_failed"] > 0


def test_a_capacity_larger_than_the_file_system_is_refused_by_name(disk_dir: str) -> None:
    cfg = load_config(None, SMALL + disk(disk_dir, "offload.disk.capacity=1000TiB"))
    with (
        LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers,
        pytest.raises(ConfigError, match=r"offload\.disk\.capacity"),
    ):
        EngineCore(cfg, workers)


def test_a_path_that_cannot_hold_files_is_refused_by_name(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"offload\.disk.*is not a directory"):
        load_config(None, disk(str(blocker / "tier")))
    with pytest.raises(ConfigError, match=r"offload\.disk.*needs path"):
        load_config(None, ["offload.disk.enabled=true"])
    with pytest.raises(ConfigError, match=r"offload\.disk\.policy"):
        load_config(None, ["offload.disk.policy=nope"])


def test_direct_io_on_and_off_mean_the_words_not_yaml_booleans() -> None:
    # YAML 1.1 reads a bare on/off as true/false: ``direct_io: off`` was refused
    for text, mode in (("off", "off"), ("on", "on"), ("auto", "auto")):
        assert load_config(None, [f"offload.disk.direct_io={text}"]).offload.disk.direct_io == mode


def test_a_rank_that_died_before_dropping_a_file_drops_it_after_its_replacement(
    disk_dir: str,
) -> None:
    """Found by review: the files a plan dropped were not dropped again when a rank died in
    that plan's step, so the dead rank's copy stayed, outside the tier's books, for good."""
    from raykv.transfer.disk_files import RankDirectory

    sets = SMALL + disk(disk_dir)
    cfg = load_config(None, sets)
    orphan = RankDirectory(disk_rank_root(cfg, 1)).path(0xABCDEF << 8)
    os.makedirs(os.path.dirname(orphan), exist_ok=True)
    with open(orphan, "wb") as fh:  # rank 1 only: a partial chunk, dropped by the first plan
        fh.write(b"x" * 8192)
    report, _ = run([*sets, 'faults=["kill-worker:step=0:rank=1"]'])
    assert report["rank_restarts"] == 1
    assert not os.path.exists(orphan)


def test_a_disk_that_refuses_direct_io_on_is_exit_2_naming_the_key(
    disk_dir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: a disk the engine could not use ended in a traceback and exit 1. The
    probe's answer is forced (every file system here takes O_DIRECT)."""
    import raykv.transfer.disk as disk_engine
    from raykv.cli import main

    monkeypatch.setattr(disk_engine, "probe_direct_io", lambda directory: False)
    argv = ["run", "--engine", "local", "--config", "configs/synthetic.yaml", "--num-requests", "2"]
    for s in disk(disk_dir, "offload.disk.direct_io=on"):
        argv += ["--set", s]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "offload.disk.direct_io" in err[0] and "Traceback" not in err[0]


def _chunk_files(root: str) -> dict[int, Path]:
    """A rank's chunk files by key (not the evicted ones kept in ``free/`` to write over)."""
    return {int(p.stem, 16): p for p in Path(root).glob("*/*.kv") if p.parent.name != "free"}


def test_a_restart_with_a_smaller_capacity_keeps_the_newest_chunks_and_deletes_the_rest(
    disk_dir: str,
) -> None:
    """Found by an audit: a tier restarted with a smaller capacity took what fitted in key
    order and left the rest (vLLM's kept 12 MiB under a 4 MiB capacity)."""
    from raykv.engine.disk_tier import disk_slots

    run(SMALL + disk(disk_dir))
    cfg = load_config(None, SMALL + disk(disk_dir))
    roots = [disk_rank_root(cfg, rank) for rank in range(2)]
    common = sorted(set(_chunk_files(roots[0])) & set(_chunk_files(roots[1])))
    # an age for every chunk, the same on both ranks, in no order of the keys'
    ages = {key: 1_700_000_000 + (key * 7919) % 100_003 for key in common}
    for root in roots:
        for key, path in _chunk_files(root).items():
            os.utime(path, (ages.get(key, 1), ages.get(key, 1)))
    smaller = load_config(None, SMALL + disk(disk_dir, "offload.disk.capacity=1MiB"))
    slots = disk_slots(smaller)
    assert 0 < slots < len(common), (slots, len(common))
    newest = sorted(common, key=ages.__getitem__)[-slots:]
    with LocalWorkerGroup(smaller, smaller.cpu_slots()) as workers:
        engine = EngineCore(smaller, workers, offload=True, verify=True)
        assert engine.connector is not None and engine.connector.moves is not None
        assert sorted(k for k in common if k in engine.connector.moves.disk) == sorted(newest)
        engine.step()  # the first step deletes the others' files
        for root in roots:
            assert sorted(_chunk_files(root)) == sorted(newest)
