"""The disk engine on real files: chunks round-trip byte for byte through O_DIRECT and through the
page cache, and every way a file can go wrong ends in a failed job that names it corrupt, never
in bytes from somewhere else."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from raykv.core.step import TierMove
from raykv.transfer.checksums import RowChecksums
from raykv.transfer.disk import DiskTransferEngine, DiskUnavailable
from raykv.transfer.disk_files import ChunkFormat, ChunkIdentity
from raykv.transfer.layout import KVLayout, allocate_pool

LAYOUT = KVLayout(
    num_gpu_blocks=4,
    block_size=4,
    num_groups=1,
    layers_per_group=2,
    kv_heads=2,
    head_dim=8,
    dtype="float16",
    blocks_per_chunk=2,
    num_slots=16,
)
KEYS = [(0xFEDC_BA98_7654_3210 << 8) | 3, 0x1234, (2**64 - 1) << 8]  # up to 72 bits


def engine(root: str, pool: torch.Tensor, **kwargs) -> DiskTransferEngine:
    return DiskTransferEngine(root, pool, LAYOUT, io_threads=2, **kwargs)


def filled_pool() -> torch.Tensor:
    pool = allocate_pool(LAYOUT, zero=True)
    torch.manual_seed(0)
    pool.copy_(torch.randn(pool.shape).to(pool.dtype))
    return pool


def run(eng: DiskTransferEngine, move: TierMove) -> tuple[list[int], list[int]]:
    eng.submit(move)
    eng.flush([move.job_id])
    return eng.poll()


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_chunks_round_trip_byte_for_byte(disk_dir: str, direct_io: str) -> None:
    pool = filled_pool()
    eng = engine(disk_dir, pool, direct_io=direct_io)
    try:
        assert run(eng, TierMove.of(1, False, KEYS, [0, 1, 2], False)) == ([1], [])
        assert sorted(eng.index()) == sorted(KEYS)
        before = pool[:3].clone()
        pool[5:8] = 0
        assert run(eng, TierMove.of(2, True, KEYS, [5, 6, 7], False)) == ([2], [])
        assert torch.equal(pool[5:8].view(torch.int16), before.view(torch.int16))
        stats = eng.take_stats()
        assert stats.disk_write_chunks == stats.disk_read_chunks == 3
        assert stats.disk_read_bytes == 3 * LAYOUT.chunk_bytes
    finally:
        eng.shutdown()


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 1]))


FMT = ChunkFormat(LAYOUT.page_bytes, LAYOUT.blocks_per_chunk)


@pytest.mark.parametrize(
    "damage",
    [
        "page byte",  # a bit flipped in the pages
        "header byte",  # ... in the header
        "truncated",
        "grown",
        "deleted",
        "another key's file",
    ],
)
def test_a_damaged_file_fails_its_promotion_as_corrupt_and_is_deleted(
    disk_dir: str, damage: str
) -> None:
    pool = filled_pool()
    eng = engine(disk_dir, pool)
    try:
        run(eng, TierMove.of(1, False, KEYS[:2], [0, 1], False))
        path = eng.files.path(KEYS[0])
        if damage == "page byte":
            _flip(path, FMT.header_bytes + 17)
        elif damage == "header byte":
            _flip(path, 20)
        elif damage == "truncated":
            os.truncate(path, FMT.file_bytes - 4096)
        elif damage == "grown":
            with open(path, "ab") as fh:
                fh.write(b"\0" * 4096)
        elif damage == "deleted":
            os.unlink(path)
        else:
            os.replace(eng.files.path(KEYS[1]), path)
        pool[9] = 7
        completed, failed = run(eng, TierMove.of(2, True, [KEYS[0]], [9], False))
        assert (completed, failed) == ([], [2])
        assert eng.take_corrupt() == [2]
        assert not os.path.exists(path)
    finally:
        eng.shutdown()


OURS = ChunkIdentity(bytes(range(16)), 0, 2)


@pytest.mark.parametrize(
    "theirs",
    [
        ChunkIdentity(bytes(range(16)), 1, 2),
        ChunkIdentity(bytes(range(1, 17)), 0, 2),
        ChunkIdentity(bytes(range(16)), 0, 4),
    ],
    ids=["another rank", "another namespace", "another TP size"],
)
def test_a_part_written_for_another_rank_namespace_or_tp_size_is_refused(
    disk_dir: str, tmp_path, theirs: ChunkIdentity
) -> None:
    """A file of the same key and geometry, intact, but of another rank's heads, another
    namespace's model or another TP size's split (a copy, a backup restored in the wrong place)
    was served: only the key, sizes and checksums were checked."""
    pool = filled_pool()
    other = engine(str(tmp_path / "theirs"), pool, identity=theirs)
    try:
        run(other, TierMove.of(1, False, [KEYS[0]], [0], False))
        foreign = other.files.path(KEYS[0])
    finally:
        other.shutdown()
    eng = engine(disk_dir, pool, identity=OURS)
    try:
        assert run(eng, TierMove.of(1, False, [KEYS[0]], [1], False)) == ([1], [])
        os.replace(foreign, eng.files.path(KEYS[0]))
        completed, failed = run(eng, TierMove.of(2, True, [KEYS[0]], [9], False))
        assert (completed, failed) == ([], [2])
        assert eng.take_corrupt() == [2]
        # its own files are read: the identity is what refused the other
        assert run(eng, TierMove.of(3, False, [KEYS[0]], [1], False)) == ([3], [])
        assert run(eng, TierMove.of(4, True, [KEYS[0]], [9], False)) == ([4], [])
    finally:
        eng.shutdown()


def test_a_demotion_of_cpu_bytes_that_changed_since_their_store_writes_nothing(
    disk_dir: str,
) -> None:
    pool = filled_pool()
    rows = pool.view(LAYOUT.num_slots * LAYOUT.blocks_per_chunk, LAYOUT.page_elems)
    sums = RowChecksums(rows)
    sums.record([0, 1])  # slot 0's two pages, as a store records them
    pool[0, 3] += 1  # then a bit of host memory changes
    eng = engine(disk_dir, pool, sums=sums)
    try:
        assert run(eng, TierMove.of(1, False, [KEYS[0]], [0], True)) == ([], [1])
        assert eng.take_corrupt() == [1]
        assert eng.index() == []
    finally:
        eng.shutdown()


def test_a_promotion_records_the_checksums_it_verified(disk_dir: str) -> None:
    pool = filled_pool()
    rows = pool.view(LAYOUT.num_slots * LAYOUT.blocks_per_chunk, LAYOUT.page_elems)
    sums = RowChecksums(rows)
    eng = engine(disk_dir, pool, sums=sums)
    try:
        run(eng, TierMove.of(1, False, [KEYS[0]], [0], False))
        run(eng, TierMove.of(2, True, [KEYS[0]], [4], True))
        assert sums.check([8, 9]) == (2, [])  # slot 4's pages now vouched for
        pool[4, 0] += 1
        assert sums.check([8, 9])[1] == [8]
    finally:
        eng.shutdown()


def test_the_index_sweeps_every_temporary_file_but_the_engines_own(disk_dir: str) -> None:
    """A temporary file whose pid runs (an engine of this process that came before, or a pid
    the system gave again) was never swept, nor counted in the capacity: only the holder of
    the directory's lock writes there, so every other writer's is a crash's leftover."""
    pool = filled_pool()
    eng = engine(disk_dir, pool)
    try:
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        pid = int(dead.stdout)
        sub = os.path.join(disk_dir, "00")
        os.makedirs(sub, exist_ok=True)  # subdirectories come with their first file
        stale = os.path.join(sub, f".{0x1234:018x}.{pid}.ab12-1.tmp")
        live = os.path.join(sub, f".{0x1234:018x}.{os.getpid()}.cd34-9.tmp")
        own = eng.files.temporary(0x1234)  # an in-flight write of this engine's
        foreign = os.path.join(sub, "notes.txt")
        for path in (stale, live, own, foreign):
            with open(path, "wb") as fh:
                fh.write(b"x")
        assert eng.index() == []
        assert not os.path.exists(stale) and not os.path.exists(live)
        assert os.path.exists(own) and os.path.exists(foreign)
    finally:
        eng.shutdown()


def test_direct_io_on_where_the_file_system_refuses_it_names_the_key(
    disk_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file system this machine has takes O_DIRECT (tmpfs too, on recent kernels), so the
    probe's answer is forced here: what is tested is the refusal, not the probe."""
    import raykv.transfer.disk as disk

    monkeypatch.setattr(disk, "probe_direct_io", lambda directory: False)
    with pytest.raises(DiskUnavailable, match=r"offload\.disk\.direct_io: on"):
        engine(disk_dir, filled_pool(), direct_io="on")
    auto = engine(disk_dir, filled_pool(), direct_io="auto")
    assert auto.io_mode == "buffered"
    auto.shutdown()


def test_free_files_are_never_handed_out_twice(disk_dir: str) -> None:
    """Found by review: free files were named by pid and a counter that a second directory of the
    same process started again, so a name already on the (adopted) free list was made again and
    two writers got one file."""
    from raykv.transfer.disk_files import RankDirectory

    first = RankDirectory(disk_dir, max_free=16)
    first.make()
    for key in (1, 2, 3):
        first.subdirectory(key)
        with open(first.path(key), "wb") as fh:
            fh.write(b"x")
        first.recycle(key)
    second = RankDirectory(disk_dir, max_free=16)  # a rank replaced in the same process
    second.scan()  # adopts the three free files
    second.subdirectory(7)
    with open(second.path(7), "wb") as fh:
        fh.write(b"y")
    second.recycle(7)
    handed = [second.take_free() for _ in range(5)]
    spares = [h for h in handed if h is not None]
    assert len(spares) == 4 and len(set(spares)) == 4
    assert all(os.path.exists(p) for p in spares)


def test_a_second_engine_on_the_same_path_takes_a_directory_of_its_own(disk_dir: str) -> None:
    pool = filled_pool()
    first = engine(disk_dir, pool)
    second = engine(disk_dir, pool)
    try:
        assert first.files.root == disk_dir
        assert second.files.root == disk_dir + ".1"
        run(first, TierMove.of(1, False, [KEYS[0]], [0], False))
        assert second.index() == []  # never takes a live engine's files
        run(second, TierMove.of(1, False, KEYS[:2], [0, 1], False))
    finally:
        first.shutdown()
        second.shutdown()
    again = engine(disk_dir, pool)  # the locks went with the engines
    try:
        # what the second engine wrote under ``.1`` was never read nor reclaimed: now it is
        # taken in (its copy of a key the first also wrote is dropped), and ``.1`` is gone
        assert again.files.root == disk_dir and sorted(again.index()) == sorted(KEYS[:2])
        assert not os.path.exists(disk_dir + ".1")
        assert run(again, TierMove.of(2, True, KEYS[:2], [5, 6], False)) == ([2], [])
    finally:
        again.shutdown()


SPECIAL = ["fifo", "directory", "link to /dev/zero", "link to a chunk's file"]


def _plant(path: str, what: str, real_file: str) -> None:
    """Put ``what`` under ``path``, where a chunk's file was."""
    if os.path.lexists(path):
        os.unlink(path)
    if what == "fifo":
        os.mkfifo(path, 0o600)
    elif what == "directory":
        os.mkdir(path)
        with open(os.path.join(path, "inside"), "w") as fh:
            fh.write("x")
    elif what == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    else:
        os.symlink(real_file, path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", SPECIAL)
def test_no_special_file_under_a_chunks_name_is_opened_or_hangs_a_thread(
    disk_dir: str, tmp_path, what: str
) -> None:
    """A FIFO in place of a file held every I/O thread in ``open`` for good (and the rank's
    recovery joined them); a directory there was recycled into ``free/`` and failed every
    demotion that picked it; a link was followed. Each is refused as no regular file, taken
    away, and the key written again works."""
    pool = filled_pool()
    eng = engine(disk_dir, pool)
    try:
        assert run(eng, TierMove.of(1, False, KEYS[:2], [0, 1], False)) == ([1], [])
        path = eng.files.path(KEYS[0])
        keep = str(tmp_path / "a-real-chunk.kv")
        os.rename(eng.files.path(KEYS[1]), keep)  # intact, of another key: a link's target
        _plant(path, what, keep)
        # a read: refused as corrupt, never served, no thread stuck
        assert run(eng, TierMove.of(2, True, [KEYS[0]], [9], False)) == ([], [2])
        assert eng.take_corrupt() == [2]
        assert not os.path.lexists(path)
        # the index and an eviction: neither takes it for a chunk, nor recycles it
        _plant(path, what, keep)
        assert KEYS[0] not in eng.index()
        assert not os.path.lexists(path)
        _plant(path, what, keep)
        eng.drop([KEYS[0]])
        assert not os.path.lexists(path) and not os.listdir(eng.files.free_dir)
        # a write over it: the file takes its place
        _plant(path, what, keep)
        assert run(eng, TierMove.of(3, False, [KEYS[0]], [0], False)) == ([3], [])
        assert run(eng, TierMove.of(4, True, [KEYS[0]], [9], False)) == ([4], [])
        assert eng.take_stats().disk_special >= 3
    finally:
        assert eng.shutdown(timeout_s=10) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["fifo", "directory"])
def test_a_special_file_in_the_free_list_is_never_written_over(
    disk_dir: str, tmp_path, what: str
) -> None:
    pool = filled_pool()
    eng = engine(disk_dir, pool)
    try:
        assert run(eng, TierMove.of(1, False, KEYS[:1], [0], False)) == ([1], [])
        eng.drop([KEYS[0]])  # its file goes to free/, to be written over
        (spare,) = os.listdir(eng.files.free_dir)
        _plant(os.path.join(eng.files.free_dir, spare), what, "")
        assert run(eng, TierMove.of(2, False, KEYS[1:2], [1], False)) == ([2], [])
        assert run(eng, TierMove.of(3, True, KEYS[1:2], [9], False)) == ([3], [])
        assert not os.listdir(eng.files.free_dir)
    finally:
        eng.shutdown()


def hang_reads(eng: DiskTransferEngine) -> tuple[threading.Event, threading.Event]:
    """Make ``eng``'s chunk reads hang until released, as a file system that stops answering
    would (a fake: real files cannot hang on demand): (set once a read hangs, the release)."""
    entered, release = threading.Event(), threading.Event()
    real_read = eng.chunks.read

    def hung_read(key: int, slot: int, check: bool) -> None:
        entered.set()
        release.wait()
        real_read(key, slot, check)

    eng.chunks.read = hung_read
    return entered, release


def test_a_shutdown_leaves_a_thread_stuck_in_a_system_call_behind(disk_dir: str) -> None:
    """Recovery (a rank's ``die``) joined its I/O threads without a bound: one stuck in a
    system call the tier never answers hung the rank for good."""
    pool = filled_pool()
    eng = engine(disk_dir, pool)
    entered, release = hang_reads(eng)
    try:
        run(eng, TierMove.of(1, False, KEYS[:1], [0], False))
        eng.submit(TierMove.of(2, True, KEYS[:1], [9], False))
        assert entered.wait(10)
        assert eng.shutdown(wait=False, timeout_s=0.5) == 1
    finally:
        release.set()


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's files needs root")
@pytest.mark.parametrize("where", ["namespace", "rank"])
def test_a_directory_of_another_user_is_refused_naming_the_path(disk_dir: str, where: str) -> None:
    """A chunk file carries no seal, so its directory is the boundary: a namespace's or rank's
    directory made beforehand by another user (mode 0777) was used as it was, and a file that
    user planted there was served (found by review)."""
    root = os.path.join(disk_dir, "ns", "rank-0")
    os.makedirs(root)
    os.chmod(os.path.dirname(root), 0o777)
    os.chmod(root, 0o777)
    os.chown(root if where == "rank" else os.path.dirname(root), NOBODY, NOBODY)
    with pytest.raises(DiskUnavailable, match=r"offload\.disk\.path.*another user"):
        engine(root, filled_pool())


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's files needs root")
def test_files_another_user_planted_are_never_read_nor_written_over(disk_dir: str) -> None:
    pool = filled_pool()
    eng = engine(disk_dir, pool)
    try:
        assert run(eng, TierMove.of(1, False, KEYS[:1], [0], False)) == ([1], [])
        os.chown(eng.files.path(KEYS[0]), NOBODY, NOBODY)  # intact, but not this user's
        assert run(eng, TierMove.of(2, True, KEYS[:1], [9], False)) == ([], [2])
        planted = os.path.join(eng.files.free_dir, ".free-planted")
        with open(planted, "wb") as fh:
            fh.write(b"theirs")
        os.chown(planted, NOBODY, NOBODY)
        eng.index()  # adopts free files: the planted one is never written over
        assert run(eng, TierMove.of(3, False, KEYS[1:2], [1], False)) == ([3], [])
        assert not os.path.exists(planted)
        assert os.stat(eng.files.path(KEYS[1])).st_uid == os.geteuid()
    finally:
        eng.shutdown()


def test_links_in_place_of_the_tiers_own_directories_are_never_followed(
    disk_dir: str, tmp_path
) -> None:
    """``free/`` (or a key's subdirectory) replaced by a link to another directory: the
    engine adopted the files there as free ones, wrote chunks over them and renamed them into
    the tier (found by review); a linked namespace directory failed the start with a
    traceback."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("mine")
    pool = filled_pool()
    eng = engine(disk_dir, pool)
    eng.shutdown()
    import shutil

    shutil.rmtree(os.path.join(disk_dir, "free"))
    os.symlink(victim, os.path.join(disk_dir, "free"))
    sub = os.path.dirname(eng.files.path(KEYS[0]))
    if os.path.lexists(sub):
        shutil.rmtree(sub)
    os.symlink(victim, sub)
    eng = engine(disk_dir, pool)
    try:
        eng.index()
        assert run(eng, TierMove.of(1, False, KEYS[:1], [0], False)) == ([1], [])
        assert (victim / "thesis.tex").read_text() == "mine"
        assert sorted(os.listdir(victim)) == ["thesis.tex"]
        assert not os.path.islink(os.path.join(disk_dir, "free")) and not os.path.islink(sub)
    finally:
        eng.shutdown()
    linked = tmp_path / "linked-namespace"
    os.symlink(victim, linked)
    with pytest.raises(DiskUnavailable, match=r"offload\.disk\.path.*is a link"):
        engine(str(linked / "rank-0"), pool)
    assert sorted(os.listdir(victim)) == ["thesis.tex"]  # nothing made through the link


def test_the_writes_niceness_comes_from_the_environment_where_it_is_valid(
    monkeypatch, caplog
) -> None:
    from raykv.transfer.chunk_jobs import WRITE_NICENESS, write_niceness

    monkeypatch.delenv("RAYKV_WRITE_NICENESS", raising=False)
    assert write_niceness() == WRITE_NICENESS == 19
    monkeypatch.setenv("RAYKV_WRITE_NICENESS", "5")
    assert write_niceness() == 5
    for wrong in ("20", "-1", "low"):
        caplog.clear()
        monkeypatch.setenv("RAYKV_WRITE_NICENESS", wrong)
        assert write_niceness() == 19
        assert "RAYKV_WRITE_NICENESS" in caplog.text


@pytest.mark.parametrize(("given", "levels"), [(None, 10), ("3", 3)])
def test_an_engine_s_writes_run_at_its_own_niceness_unless_the_environment_says(
    disk_dir: str, monkeypatch, given: str | None, levels: int
) -> None:
    # inside vLLM a store completes only when its writes do: they run 10 levels down, not 19
    if given is None:
        monkeypatch.delenv("RAYKV_WRITE_NICENESS", raising=False)
    else:
        monkeypatch.setenv("RAYKV_WRITE_NICENESS", given)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base + 10 >= 19:
        pytest.skip(f"this process runs at nice {base}: 10 levels and 19 would look the same")
    eng = engine(disk_dir, filled_pool(), write_niceness=10)
    try:
        assert run(eng, TierMove.of(1, False, KEYS, [0, 1, 2], False)) == ([1], [])
        assert run(eng, TierMove.of(2, True, KEYS, [5, 6, 7], False)) == ([2], [])

        def niceness(threads) -> set[int]:
            return {os.getpriority(os.PRIO_PROCESS, thread.native_id) for thread in threads}

        assert niceness(eng._writes._threads) == {base + levels}
        assert niceness(eng._reads._threads) == {base}  # a request waits for a promotion
    finally:
        eng.shutdown()


def test_a_directory_removed_under_a_running_engine_is_made_again_and_said_once(
    disk_dir: str, caplog
) -> None:
    """Found by an audit: ``rm -rf`` of the tier's path under a running engine failed every
    later write, with a warning per chunk, until a restart."""
    import logging
    import shutil

    pool = filled_pool()
    root = os.path.join(disk_dir, "namespace", "rank-0")
    eng = engine(root, pool)
    try:
        assert run(eng, TierMove.of(1, False, KEYS[:1], [0], False)) == ([1], [])
        shutil.rmtree(os.path.join(disk_dir, "namespace"))
        with caplog.at_level(logging.WARNING):
            assert run(eng, TierMove.of(2, False, KEYS[1:], [1, 2], False)) == ([2], [])
            assert run(eng, TierMove.of(3, False, KEYS[:1], [0], False)) == ([3], [])
        assert sorted(eng.index()) == sorted(KEYS)
        assert caplog.text.count("was removed while in use") == 1
        assert "disk job" not in caplog.text  # no failed chunk, no warning per chunk
        assert os.stat(root).st_mode & 0o777 == 0o700
        pool[5:8] = 0
        assert run(eng, TierMove.of(4, True, KEYS, [5, 6, 7], False)) == ([4], [])
    finally:
        eng.shutdown()
