"""Shared-memory CPU-pool shards: attach after a death, fresh otherwise, clean-up of files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from raykv.transfer.layout import KVLayout
from raykv.transfer.pool_files import (
    PoolFiles,
    process_id,
    remove_generations,
    successor_path,
    sweep_stale,
)
from raykv.transfer.shared_pool import SharedPool, SharedPoolUnavailable


def layout(num_slots: int = 6) -> KVLayout:
    return KVLayout(
        num_gpu_blocks=8,
        block_size=4,
        num_groups=1,
        layers_per_group=2,
        kv_heads=1,
        head_dim=4,
        dtype="float16",
        blocks_per_chunk=2,
        num_slots=num_slots,
    )


def test_a_second_mapping_of_the_same_file_sees_the_first_ones_bytes(tmp_path) -> None:
    files = PoolFiles.new(str(tmp_path))
    first = SharedPool(files.path(0), layout())
    assert not first.attached and tuple(first.tensor.shape) == (6, layout().page_elems * 2)
    first.tensor[3].copy_(torch.arange(first.tensor.shape[1], dtype=torch.float16))
    again = SharedPool(files.path(0), layout())  # what a replacement rank does
    assert again.attached
    assert torch.equal(again.tensor[3], first.tensor[3])
    again.tensor[5].fill_(7)
    assert torch.all(first.tensor[5] == 7)  # one memory, two mappings


def test_a_file_of_another_size_is_not_attached(tmp_path) -> None:
    files = PoolFiles.new(str(tmp_path))
    SharedPool(files.path(0), layout(num_slots=6))
    other_layout = layout(num_slots=7)
    other = SharedPool(files.path(0), other_layout)
    assert not other.attached and other.tensor.shape[0] == 7
    # the pool (float16) and one int64 checksum per page row
    assert os.path.getsize(files.path(0)) == other.tensor.numel() * 2 + other.sums.numel() * 8
    pages = 7 * other_layout.blocks_per_chunk
    assert other.sums.numel() == pages and bool((other.sums == -1).all())


def test_checksums_survive_in_the_file_for_the_next_rank(tmp_path) -> None:
    files = PoolFiles.new(str(tmp_path))
    first = SharedPool(files.path(0), layout(num_slots=6))
    first.sums[2] = 12345
    again = SharedPool(files.path(0), layout(num_slots=6))
    assert again.attached and int(again.sums[2]) == 12345 and int(again.sums[3]) == -1


def test_a_pool_larger_than_the_directory_is_refused_by_name(tmp_path, monkeypatch) -> None:
    class Tiny:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(os, "statvfs", lambda _: Tiny())
    with pytest.raises(SharedPoolUnavailable, match=r"offload\.shared_pool_dir"):
        SharedPool(PoolFiles.new(str(tmp_path)).path(0), layout(num_slots=1000))


def test_files_are_removed_by_run_by_rank_and_when_their_owner_is_gone(tmp_path) -> None:
    mine = PoolFiles.new(str(tmp_path))
    for rank, gen in [(0, 0), (1, 0), (1, 1), (1, 2)]:
        SharedPool(mine.path(rank, gen), layout())
    remove_generations(mine.path(1, 2), keep=True)  # a fresh generation: older ones go
    names = sorted(os.listdir(tmp_path))
    assert names == sorted(os.path.basename(mine.path(*rg)) for rg in [(0, 0), (1, 2)])
    remove_generations(mine.path(1, 2))  # shutdown: its own goes too
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(mine.path(0))]
    # a run whose owner process has exited left a file: the next run's sweep removes it
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    host = socket.gethostname()
    orphan = PoolFiles(str(tmp_path), f"{host}-{int(dead.stdout)}-abc123").path(0)
    SharedPool(orphan, layout())
    assert sweep_stale(str(tmp_path)) == [orphan]  # ours stays: this process is alive
    assert os.listdir(tmp_path) == [os.path.basename(mine.path(0))]
    assert mine.remove() == 1 and not os.listdir(tmp_path)


def test_a_rank_without_room_in_shared_memory_falls_back_to_private_memory(
    tmp_path, monkeypatch, caplog
) -> None:
    from raykv.transfer.rank import build_rank

    class Tiny:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(os, "statvfs", lambda _: Tiny())
    big = layout(num_slots=1000)
    res = build_rank(big, 0, "cpu", pool_path=PoolFiles.new(str(tmp_path)).path(0))
    try:
        assert res.shared is None and not res.pool_attached
        assert tuple(res.pool.shape) == (1000, big.page_elems * 2)
        assert "private memory" in caplog.text and "shared_pool_dir" in caplog.text
        assert not os.listdir(tmp_path)  # nothing half-made left for a successor
    finally:
        res.engine.shutdown()


def test_a_successor_maps_the_shard_only_once_its_predecessor_has_exited(tmp_path) -> None:
    path = PoolFiles.new(str(tmp_path)).path(1, generation=3)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    ns = process_id()[1]
    assert successor_path(path, (int(gone.stdout), ns), wait_s=5) == path
    lingering = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:  # still alive after the wait: a fresh shard of the next generation
        assert successor_path(path, (lingering.pid, ns), wait_s=0.2).endswith("-r1g4.pool")
    finally:
        lingering.kill()
        lingering.wait()
    exiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    assert successor_path(path, (exiting.pid, ns), wait_s=20) == path  # exited while waited for
    exiting.wait()
    # a process in another pid namespace cannot be watched from here: never share with it
    assert successor_path(path, (int(gone.stdout), -1), wait_s=5).endswith("-r1g4.pool")


def test_a_missing_directory_is_named_and_the_rank_still_serves(tmp_path, caplog) -> None:
    from raykv.transfer.rank import build_rank

    path = PoolFiles.new(str(tmp_path / "no-such-dir")).path(0)
    with pytest.raises(SharedPoolUnavailable, match="no-such-dir"):
        SharedPool(path, layout())
    res = build_rank(layout(), 0, "cpu", pool_path=path)  # e.g. macOS: no /dev/shm
    try:
        assert res.shared is None and "private memory" in caplog.text
    finally:
        res.engine.shutdown()


def test_the_file_system_of_a_path_is_its_longest_mount_point_with_names_unescaped(
    tmp_path,
) -> None:
    """How a CUDA rank names why it could not page-lock its shard: the mount table's escapes
    (a space as \\040, a backslash as \\134) undone, bytes that are not UTF-8 read as bytes."""
    from raykv.transfer.shared_pool import filesystem_type

    table = tmp_path / "mounts"
    table.write_bytes(
        b"/dev/root / ext4 rw 0 0\n"
        b"tmpfs /dev/shm tmpfs rw 0 0\n"
        b"fast /mnt/my\\040disk xfs rw 0 0\n"
        b"odd /mnt/caf\\351 btrfs rw 0 0\n"
    )
    assert filesystem_type("/dev/shm/raykv-x.pool", str(table)) == "tmpfs"
    assert filesystem_type("/mnt/my disk/kv", str(table)) == "xfs"
    assert filesystem_type("/mnt/my", str(table)) == "ext4"  # a prefix of a name is not inside
    assert filesystem_type(os.fsdecode(b"/mnt/caf\xe9/x"), str(table)) == "btrfs"
    assert filesystem_type("/work", str(tmp_path / "no-such-table")) == "unknown"
    assert filesystem_type("/dev/shm") == "tmpfs"  # this machine's own table
