"""A synthetic model: deterministic KV whose every element the offloading path must preserve.

The KV the model writes for a token is a hash of (parent hash of its block, offset in the block,
token id, KV group, layer, K or V, GLOBAL head index, dim). What a request samples is a checksum of
the raw bytes of the blocks it reads. So a block that comes back from the CPU tier with one wrong
bit, in the wrong order, or from the wrong slot changes the generated tokens, and a verify mode can
compare any block with :meth:`SyntheticModel.block_page`.

The hashing is splitmix64's finaliser: in Python for the per-token and per-coordinate parts, and
one multiply + xor-shift in torch int64 arithmetic (which wraps modulo 2^64, like unsigned
integers) per element, with logical right shifts emulated by masking. Integer arithmetic is exact,
so values are identical on every machine and device; the conversion to the KV dtype only rounds
multiples of 1/512, deterministically.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raykv.core.step import BlockContent, ModelEntry, ModelOutput, WriteSpan
from raykv.transfer.layout import KVLayout, pool_rows

_MASK64 = (1 << 64) - 1
_MERSENNE61 = (1 << 61) - 1

# splitmix64 constants plus a few odd multipliers that spread each coordinate over all 64 bits
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_GOLDEN = 0x9E3779B97F4A7C15
_K_GROUP = 0xD6E8FEB86659FD93
_K_TOKEN = 0xA0761D6478BD642F
_K_OFFSET = 0xE7037ED1A0B428DB
_K_LAYER = 0x8EBC6AF09C88C6E3
_K_KV = 0x589965CC75374CC3
_K_HEAD = 0x1D8E4E27C47D124F
_K_DIM = 0xC2B2AE3D27D4EB4F
_K_WEIGHT = 0x165667B19E3779F9
_K_POSITION = 0x27D4EB2F165667C5

# integer views used to compare and checksum raw bytes, by element width
_INT_VIEW: dict[int, torch.dtype] = {2: torch.int16, 4: torch.int32}

# cap on the int64 scratch a checksum batch uses (elements), so memory stays bounded
_CHECKSUM_BATCH_ELEMS = 1 << 21


def _signed(value: int) -> int:
    """The int64 with the same low 64 bits as ``value`` (torch has no uint64 arithmetic)."""
    value &= _MASK64
    return value - (1 << 64) if value >= (1 << 63) else value


def mix64(value: int) -> int:
    """splitmix64's finaliser on a Python int (unsigned 64-bit in, unsigned 64-bit out)."""
    z = value & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _srl(x: torch.Tensor, shift: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; masking off the sign-extended bits makes it logical
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix64` element-wise on an int64 tensor (the bits of each result equal mix64's)."""
    x = x ^ _srl(x, 30)
    x = x * _signed(_MIX1)
    x = x ^ _srl(x, 27)
    x = x * _signed(_MIX2)
    return x ^ _srl(x, 31)


class SyntheticModel:
    """The KV writer, page builder, verifier and checksum of one tensor-parallel rank.

    The KV of a token depends on the rank only through the global head index
    (``rank * layout.kv_heads + h``), so the ranks of one model hold disjoint head slices of the
    same unsharded KV.
    """

    def __init__(
        self,
        layout: KVLayout,
        rank: int = 0,
        tp_size: int = 1,
        device: str | torch.device = "cpu",
    ) -> None:
        if tp_size <= 0:
            raise ValueError(f"tp_size must be positive, got {tp_size}")
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank must be in [0, {tp_size}), got {rank}")
        if layout.elem_bytes not in _INT_VIEW:
            raise ValueError(f"no integer view for {layout.dtype} elements")
        self.layout = layout
        self.rank = rank
        self.tp_size = tp_size
        self.device = torch.device(device)
        self._int_dtype = _INT_VIEW[layout.elem_bytes]
        self._coords = self._coordinate_hashes()
        # the checksum reads a page as the widest integers its size allows (fewer, cheaper
        # multiply-adds, no widening copy); odd weights are invertible modulo 2^64, so any change
        # of one word alters the sum
        self._word = next(
            d
            for d, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))
            if layout.page_bytes % size == 0
        )
        words = layout.page_bytes // torch.empty((), dtype=self._word).element_size()
        idx = torch.arange(words, dtype=torch.int64, device=self.device)
        self._weights = mix64_tensor(idx + _signed(_K_WEIGHT)) | 1

    def _coordinate_hashes(self) -> torch.Tensor:
        """Hash of (layer, k/v, global head, dim), shaped ``[L, 2, H, 1, D]`` to broadcast over
        token offsets. Computed once; only the per-token part changes between writes."""
        lay = self.layout
        dev = self.device

        def axis(n: int, start: int, mult: int, dim: int) -> torch.Tensor:
            shape = [1, 1, 1, 1, 1]
            shape[dim] = n
            values = torch.arange(start, start + n, dtype=torch.int64, device=dev)
            return (values * _signed(mult)).view(shape)

        combined = (
            axis(lay.layers_per_group, 0, _K_LAYER, 0)
            + axis(2, 0, _K_KV, 1)
            + axis(lay.kv_heads, self.rank * lay.kv_heads, _K_HEAD, 2)
            + axis(lay.head_dim, 0, _K_DIM, 4)
        )
        return mix64_tensor(combined)

    def _values(
        self, group: int, parent_hash: int, offsets: Sequence[int], tokens: Sequence[int]
    ) -> torch.Tensor:
        """KV for ``len(offsets)`` tokens of one block: ``[L, 2, H, n, D]`` in the layout dtype.

        The per-token part (a few ints) is mixed in Python; the per-element part was mixed once
        at start-up (``_coords``); what is left for torch is one multiply and one xor-shift over
        the page, a handful of kernels whatever the page size."""
        seed = mix64((parent_hash & _MASK64) ^ mix64(group * _K_GROUP + _GOLDEN))
        per_token = [
            _signed(mix64(mix64(t * _K_TOKEN + seed) ^ ((o * _K_OFFSET) & _MASK64)))
            for t, o in zip(tokens, offsets, strict=True)
        ]
        x = torch.tensor(per_token, dtype=torch.int64, device=self.device).view(1, 1, 1, -1, 1)
        x = (x + self._coords) * _signed(_MIX2)  # wraps modulo 2^64
        x = x ^ _srl(x, 29)
        # ten bits scaled to [-1, 1): sized like real KV, exact in float16 and float32
        values = ((x & 0x3FF) - 512).to(torch.float32) / 512.0
        return values.to(self.layout.torch_dtype)

    def _check_kv(self, kv: torch.Tensor) -> None:
        lay = self.layout
        if kv.dim() != 2 or kv.shape[1] != lay.page_elems or kv.dtype != lay.torch_dtype:
            raise ValueError(
                f"kv must be [*, {lay.page_elems}] of {lay.dtype}, "
                f"got {list(kv.shape)} of {kv.dtype}"
            )

    def write(self, kv: torch.Tensor, span: WriteSpan) -> None:
        """Write the KV of ``span.tokens`` (positions ``span.start ..``) into ``span.blocks``.

        A span that starts a block (offset 0) and ends inside it zeroes the rest of the page: the
        KV a request's last, partly filled block holds is then independent of the block's past.
        """
        self._check_kv(kv)
        n = len(span.tokens)
        if n == 0:
            return
        bs = self.layout.block_size
        if span.start < 0:
            raise ValueError(f"WriteSpan.start must be >= 0, got {span.start}")
        first = span.start // bs
        touched = (span.start + n - 1) // bs - first + 1
        if len(span.blocks) != touched or len(span.parent_hashes) != touched:
            raise ValueError(
                f"a span of {n} tokens from position {span.start} touches {touched} blocks, got "
                f"{len(span.blocks)} blocks and {len(span.parent_hashes)} parent hashes"
            )
        tokens = span.tokens
        end = span.start + n
        for i, (block, parent) in enumerate(zip(span.blocks, span.parent_hashes, strict=True)):
            block_start = (first + i) * bs
            lo = max(span.start, block_start)
            hi = min(end, block_start + bs)
            offsets = range(lo - block_start, hi - block_start)
            values = self._values(
                span.group, parent, offsets, tokens[lo - span.start : hi - span.start]
            )
            page = kv[block].view(self.layout.page_shape)
            if lo == block_start and hi < block_start + bs:
                # a block's first write: clear what its previous owner left past the span, so a
                # partly filled block reads the same whoever had it before
                page[:, :, :, hi - block_start :, :] = 0
            page[:, :, :, lo - block_start : hi - block_start, :] = values

    def step(self, kv: torch.Tensor, batch: list[ModelEntry]) -> ModelOutput:
        """A step's batch: write every span's KV, then checksum what each sampling entry reads
        (0 for one that does not sample this step)."""
        bs = self.layout.block_size
        for entry in batch:
            for span in entry.writes(bs):
                self.write(kv, span)
        return ModelOutput([self.checksum(kv, e.read_blocks()) if e.samples else 0 for e in batch])

    def block_page(self, content: BlockContent) -> torch.Tensor:
        """The page ``[page_elems]`` a full block with this content holds (what :meth:`write`
        writes for the same group, parent hash and tokens)."""
        bs = self.layout.block_size
        if len(content.tokens) != bs:
            raise ValueError(f"a full block has {bs} tokens, got {len(content.tokens)}")
        values = self._values(content.group, content.parent_hash, range(bs), content.tokens)
        return values.reshape(-1)

    def verify(self, kv: torch.Tensor, block: int, content: BlockContent) -> bool:
        """Whether ``kv[block]`` equals :meth:`block_page` bit for bit."""
        self._check_kv(kv)
        expected = self.block_page(content)
        return bool(torch.equal(kv[block].view(self._int_dtype), expected.view(self._int_dtype)))

    def verify_row(
        self, pool: torch.Tensor, layout: KVLayout, slot: int, sub: int, content: BlockContent
    ) -> bool:
        """Whether position ``sub`` of CPU slot ``slot`` holds :meth:`block_page` bit for bit."""
        row = pool_rows(pool, layout)[slot * layout.blocks_per_chunk + sub]
        expected = self.block_page(content).to(row.device)
        return bool(torch.equal(row.view(self._int_dtype), expected.view(self._int_dtype)))

    def checksum(self, kv: torch.Tensor, blocks: list[int]) -> int:
        """An exact integer digest of the raw bytes of ``kv[blocks]`` and of their order.

        Per page: the int64 (wrapping) dot product of its raw bytes read as the widest integers
        the page size allows with fixed odd weights, then mixed with the page's position in the
        list; the results are summed modulo
        2^61 - 1. Wrapping sums do not depend on reduction order, so the digest is identical on
        every machine and device. Empty list -> 0.
        """
        self._check_kv(kv)
        if not blocks:
            return 0
        per_batch = max(1, _CHECKSUM_BATCH_ELEMS // self.layout.page_elems)
        total = 0
        for base in range(0, len(blocks), per_batch):
            batch = blocks[base : base + per_batch]
            idx = torch.tensor(batch, dtype=torch.int64, device=kv.device)
            pages = kv.index_select(0, idx).view(self._word)
            if self._word is not torch.int64:
                pages = pages.to(torch.int64)
            pages *= self._weights.to(kv.device)  # wraps modulo 2^64, like the sum below
            sums = pages.sum(dim=1).tolist()
            for j, page_sum in enumerate(sums):
                position_key = mix64((base + j) * _K_POSITION + _GOLDEN)
                total += mix64((page_sum & _MASK64) ^ position_key)
        return total % _MERSENNE61
