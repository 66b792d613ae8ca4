"""Memory layout of one rank's KV cache and of its CPU pool.

The GPU KV cache is one tensor ``[num_gpu_blocks, page_elems]``: a row (a "page") holds every
layer of ONE KV group for one block on this rank, so a block moves as one contiguous copy unit.
Inside a page the element order is ``[layer][k_or_v][head][token_offset][dim]``; putting heads
before tokens makes a tensor-parallel rank's page exactly a head slice of the unsharded page.

The CPU pool is ``[num_slots, page_elems * blocks_per_chunk]``: a slot holds a chunk of
``blocks_per_chunk`` consecutive pages, and :func:`pool_rows` views it page by page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}

_POSITIVE_FIELDS = (
    "num_gpu_blocks",
    "block_size",
    "num_groups",
    "layers_per_group",
    "kv_heads",
    "head_dim",
    "blocks_per_chunk",
    "num_slots",
)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one rank's KV cache and CPU pool.

    ``kv_heads`` counts the heads held by ONE rank (the model's KV heads / tp_size).
    """

    num_gpu_blocks: int
    block_size: int
    num_groups: int
    layers_per_group: int
    kv_heads: int
    head_dim: int
    dtype: str
    blocks_per_chunk: int
    num_slots: int

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            # bool is an int subclass; a True here is always a caller bug
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"KVLayout.{name} must be an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {value}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of every KV element."""
        return _DTYPES[self.dtype]

    @property
    def elem_bytes(self) -> int:
        """Bytes per KV element."""
        return self.torch_dtype.itemsize

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """``(layers, 2, heads, block_size, head_dim)``: the page viewed as a 5-d tensor."""
        return (self.layers_per_group, 2, self.kv_heads, self.block_size, self.head_dim)

    @property
    def page_elems(self) -> int:
        """Elements in one page (one block, one KV group, all its layers, this rank)."""
        return self.layers_per_group * 2 * self.kv_heads * self.block_size * self.head_dim

    @property
    def page_bytes(self) -> int:
        """Bytes in one page."""
        return self.page_elems * self.elem_bytes

    @property
    def chunk_bytes(self) -> int:
        """Bytes in one CPU slot (``blocks_per_chunk`` pages)."""
        return self.page_bytes * self.blocks_per_chunk


def allocate_kv(layout: KVLayout, device: str | torch.device = "cpu") -> torch.Tensor:
    """The "GPU" KV cache: ``[num_gpu_blocks, page_elems]``, zero-filled, on ``device``."""
    return torch.zeros(
        (layout.num_gpu_blocks, layout.page_elems), dtype=layout.torch_dtype, device=device
    )


def allocate_pool(layout: KVLayout, pin: bool = False, zero: bool = False) -> torch.Tensor:
    """The CPU pool: ``[num_slots, page_elems * blocks_per_chunk]``.

    The memory is left uninitialised (``torch.empty``) unless ``zero``: zero-filling touches every
    page up front (about 0.5 s per GiB), while an empty pool is only paid for as slots are first
    written (or as ``transfer/populate.py`` faults it in, in the background, without a write).
    The connector never reads a slot before a store has written it, so garbage is harmless;
    tests that compare pool contents pass ``zero=True``.

    ``pin`` page-locks the memory for asynchronous DMA, but only where CUDA exists: on a CPU-only
    torch build pinning raises, and there is nothing to DMA to anyway.
    """
    shape = (layout.num_slots, layout.page_elems * layout.blocks_per_chunk)
    pin_memory = pin and torch.cuda.is_available()
    pool = torch.empty(shape, dtype=layout.torch_dtype, pin_memory=pin_memory)
    if zero:
        pool.zero_()
    return pool


def pool_rows(pool: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """``pool`` viewed page by page: ``[num_slots * blocks_per_chunk, page_elems]``.

    The page at position ``sub`` of slot ``slot`` is row ``slot * blocks_per_chunk + sub``.
    """
    expected = (layout.num_slots, layout.page_elems * layout.blocks_per_chunk)
    if tuple(pool.shape) != expected:
        raise ValueError(f"pool shape {tuple(pool.shape)} does not match the layout {expected}")
    return pool.view(layout.num_slots * layout.blocks_per_chunk, layout.page_elems)
