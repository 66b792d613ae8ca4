"""KVLayout validation and sizes; allocation helpers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raykv.transfer.layout import KVLayout, allocate_kv, allocate_pool, pool_rows

BASE = dict(
    num_gpu_blocks=10,
    block_size=16,
    num_groups=2,
    layers_per_group=4,
    kv_heads=2,
    head_dim=64,
    dtype="bfloat16",
    blocks_per_chunk=3,
    num_slots=5,
)


def test_sizes() -> None:
    lay = KVLayout(**BASE)
    assert lay.page_elems == 4 * 2 * 2 * 16 * 64
    assert lay.elem_bytes == 2
    assert lay.page_bytes == lay.page_elems * 2
    assert lay.chunk_bytes == lay.page_bytes * 3
    assert lay.torch_dtype is torch.bfloat16
    assert lay.page_shape == (4, 2, 2, 16, 64)
    assert KVLayout(**{**BASE, "dtype": "float32"}).elem_bytes == 4
    assert KVLayout(**{**BASE, "dtype": "float16"}).torch_dtype is torch.float16


@pytest.mark.parametrize(
    "name",
    [
        "num_gpu_blocks",
        "block_size",
        "num_groups",
        "layers_per_group",
        "kv_heads",
        "head_dim",
        "blocks_per_chunk",
        "num_slots",
    ],
)
@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_rejects_non_positive_fields(name: str, bad: object) -> None:
    with pytest.raises(ValueError, match=name):
        KVLayout(**{**BASE, name: bad})


def test_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(**{**BASE, "dtype": "int8"})


def test_frozen() -> None:
    lay = KVLayout(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.num_slots = 3  # type: ignore[misc]


def test_allocations_and_pool_rows() -> None:
    lay = KVLayout(**BASE)
    kv = allocate_kv(lay)
    assert kv.shape == (10, lay.page_elems)
    assert kv.dtype is torch.bfloat16
    assert not kv.any()
    pool = allocate_pool(lay, pin=True, zero=True)  # pin is ignored without CUDA
    assert pool.shape == (5, lay.page_elems * 3)
    assert not pool.any()
    rows = pool_rows(pool, lay)
    assert rows.shape == (15, lay.page_elems)
    assert rows.data_ptr() == pool.data_ptr()  # a view, not a copy
    # row of (slot 2, sub 1) is 2 * 3 + 1 and lies in slot 2's second page
    rows[7].fill_(1.5)
    assert torch.all(pool[2, lay.page_elems : 2 * lay.page_elems] == 1.5)
    assert int((pool != 0).sum()) == lay.page_elems


def test_pool_rows_checks_shape() -> None:
    lay = KVLayout(**BASE)
    with pytest.raises(ValueError, match="pool shape"):
        pool_rows(torch.zeros(4, lay.page_elems * 3, dtype=torch.bfloat16), lay)
