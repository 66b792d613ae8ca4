"""A CPU pool's pages faulted in at start, in the background, without a byte of it changed
(``transfer/populate.py``): residency read back with the kernel's ``mincore``."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import pytest
import torch

from raykv.transfer import populate
from raykv.transfer.populate import PagePopulator, populate_in_background

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_fraction(tensor: torch.Tensor) -> float:
    """The share of the tensor's whole pages that are in memory now."""
    page = mmap.PAGESIZE
    address = tensor.data_ptr()
    start = -(-address // page) * page
    end = (address + tensor.numel() * tensor.element_size()) // page * page
    pages = (end - start) // page
    vector = (ctypes.c_ubyte * pages)()
    assert _libc.mincore(start, end - start, vector) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vector) / pages


def untouched(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Fresh anonymous memory (torch's allocator may hand back pages a freed tensor touched)."""
    memory = mmap.mmap(-1, nbytes)
    return memory, torch.frombuffer(memory, dtype=torch.uint8)


def test_a_pools_pages_are_faulted_in_with_what_was_written_kept() -> None:
    memory, flat = untouched(16 << 20)
    pool = flat.view(64, 256 * 1024)
    assert resident_fraction(pool) < 0.5
    pool[3].fill_(7)  # a store that landed before the populator got there
    pool[40, 100:200] = torch.arange(100, dtype=torch.uint8)
    populator = populate_in_background(pool)
    assert isinstance(populator, PagePopulator)
    assert populator.done.wait(30)
    if populator.refused:
        pytest.skip("this kernel does not populate ahead of use (MADV_POPULATE_WRITE, Linux 5.14)")
    assert populator.populated == pool.numel()
    assert resident_fraction(pool) == 1.0
    assert bool((pool[3] == 7).all())
    assert torch.equal(pool[40, 100:200], torch.arange(100, dtype=torch.uint8))
    del pool, flat
    memory.close()


def test_a_pool_not_aligned_to_pages_is_populated_across_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's allocations start mid-page: the pages at the steps' seams are populated too."""
    monkeypatch.setattr(populate, "STEP_BYTES", 64 * mmap.PAGESIZE)
    memory, flat = untouched(1 << 20)
    pool = flat[100:]  # starts 100 bytes into a page, as torch's tensors do
    populator = PagePopulator(pool)
    assert populator.done.wait(30)
    if populator.refused:
        pytest.skip("this kernel does not populate ahead of use (MADV_POPULATE_WRITE, Linux 5.14)")
    assert resident_fraction(pool) == 1.0
    del pool, flat
    memory.close()


def test_a_stopped_populator_ends_between_two_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(populate, "STEP_BYTES", mmap.PAGESIZE)  # 16,384 calls to go
    memory, pool = untouched(64 << 20)
    populator = PagePopulator(pool)
    populator.stop()
    assert populator.done.is_set()
    assert populator.populated < pool.numel()
    assert resident_fraction(pool) < 0.5
    del pool
    memory.close()


def test_a_pool_larger_than_the_memory_left_is_left_to_fault(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Populating would make the whole pool resident at once: never more than the process may
    still take (the memory left stands in for a small cgroup limit here)."""
    monkeypatch.setattr(populate, "memory_left", lambda: 8 << 20)
    assert populate_in_background(torch.empty(16 << 20, dtype=torch.uint8)) is None
    monkeypatch.setattr(populate, "memory_left", lambda: 1 << 30)
    populator = populate_in_background(torch.empty(16 << 20, dtype=torch.uint8))
    assert populator is not None and populator.done.wait(30)


def test_an_empty_pool_needs_no_thread() -> None:
    assert populate_in_background(torch.empty((0, 16), dtype=torch.uint8)) is None


@pytest.mark.parametrize(
    ("files", "room"),
    [
        ({"memory.max": "max", "memory.current": "100"}, None),
        ({"memory.max": "1000", "memory.current": "600"}, 400),
        # reclaimable page cache is not counted as used
        ({"memory.max": "1000", "memory.current": "600", "memory.stat": "inactive_file 300"}, 700),
        ({"memory.max": "not a number", "memory.current": "600"}, None),
        ({"memory.current": "600"}, None),
    ],
    ids=["no-limit", "limit", "page-cache", "unreadable", "no-limit-file"],
)
def test_the_room_a_cgroup_leaves(tmp_path, files: dict[str, str], room: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text + "\n")
    names = ("memory.max", "memory.current", "inactive_file")
    assert populate._room(str(tmp_path), *names) == room


def test_raykv_s_own_cpu_ranks_fault_a_private_pool_in_and_leave_a_shared_shard(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """raykv's own CPU ranks as the adapter's: a private pool is populated once the rank is
    built; a shard in shared memory is not (its file's pages were allocated and zeroed when
    made)."""
    from raykv.config import load_config
    from raykv.engine.workers import LocalWorkerGroup

    started: list[PagePopulator] = []
    real = populate.PagePopulator

    def counted(tensor: torch.Tensor, name: str = "raykv-populate") -> PagePopulator:
        started.append(real(tensor, name))
        return started[-1]

    monkeypatch.setattr(populate, "PagePopulator", counted)
    cfg = load_config(None, ["offload.shared_pool=false", "parallel.tensor_parallel_size=2"])
    with LocalWorkerGroup(cfg, 64, threaded=False) as workers:
        assert len(started) == 2  # one per rank
        for worker, populator in zip(workers.workers, started, strict=True):
            assert worker.populator is populator
            assert populator.done.wait(30)
            if populator.refused:
                pytest.skip("this kernel does not populate ahead of use (MADV_POPULATE_WRITE)")
            pool = worker.pool
            _, whole = populate.whole_pages(pool.data_ptr(), pool.numel() * pool.element_size())
            assert populator.populated == whole > 0
    shared = load_config(None, ["offload.shared_pool=true", f"offload.shared_pool_dir={tmp_path}"])
    with LocalWorkerGroup(shared, 64, threaded=False) as workers:
        assert workers.workers[0].shared is not None and workers.workers[0].populator is None
    assert len(started) == 2
