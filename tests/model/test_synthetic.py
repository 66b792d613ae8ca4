"""The synthetic model: writes agree with expected pages, content depends on exactly what it
should, TP shards agree with the unsharded model, and the checksum is exact and sensitive."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from raykv.core.step import BlockContent, WriteSpan
from raykv.model.synthetic import SyntheticModel, mix64, mix64_tensor
from raykv.transfer.layout import KVLayout, allocate_kv

BS = 4


def make_layout(dtype: str = "float16", kv_heads: int = 2, blocks: int = 8) -> KVLayout:
    return KVLayout(
        num_gpu_blocks=blocks,
        block_size=BS,
        num_groups=2,
        layers_per_group=3,
        kv_heads=kv_heads,
        head_dim=8,
        dtype=dtype,
        blocks_per_chunk=1,
        num_slots=4,
    )


# parent hashes cover the whole unsigned 64-bit range, including values above 2^63
PARENTS = [0x0123456789ABCDEF, 0xFEDCBA9876543210, 7, (1 << 64) - 1]


def seq_tokens(n: int) -> list[int]:
    return [(i * 7919 + 13) % 32000 for i in range(n)]


def write_chunked(
    model: SyntheticModel, kv: torch.Tensor, tokens: list[int], blocks: list[int], cuts: list[int]
) -> None:
    """Write ``tokens`` (from position 0) in spans ending at each cut, like chunked prefill."""
    start = 0
    for end in [*cuts, len(tokens)]:
        if end <= start:
            continue
        first, last = start // BS, (end - 1) // BS
        span = WriteSpan(
            group=1,
            start=start,
            tokens=tokens[start:end],
            blocks=blocks[first : last + 1],
            parent_hashes=PARENTS[first : last + 1],
        )
        model.write(kv, span)
        start = end


def content(i: int, tokens: list[int]) -> BlockContent:
    return BlockContent(
        group=1, parent_hash=PARENTS[i], tokens=tuple(tokens[i * BS : (i + 1) * BS])
    )


def test_mix64_matches_splitmix64_reference() -> None:
    # splitmix64's first output from seed 0 is a published constant
    assert mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    values = [0, 1, 0x9E3779B97F4A7C15, (1 << 63) + 5, (1 << 64) - 1]
    signed = [v - (1 << 64) if v >= 1 << 63 else v for v in values]
    out = mix64_tensor(torch.tensor(signed, dtype=torch.int64)).tolist()
    assert [o & ((1 << 64) - 1) for o in out] == [mix64(v) for v in values]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_one_span_matches_block_page(dtype: str) -> None:
    lay = make_layout(dtype)
    model = SyntheticModel(lay)
    kv = allocate_kv(lay)
    tokens = seq_tokens(3 * BS)
    blocks = [5, 0, 3]
    write_chunked(model, kv, tokens, blocks, cuts=[])
    for i, block in enumerate(blocks):
        expected = model.block_page(content(i, tokens))
        assert expected.shape == (lay.page_elems,)
        assert expected.dtype == lay.torch_dtype
        assert torch.equal(kv[block], expected)
        assert model.verify(kv, block, content(i, tokens))
    # KV-like values: in [-1, 1), not constant
    page = kv[5].float()
    assert page.min() >= -1 and page.max() < 1 and page.std() > 0.1
    # untouched blocks stay zero
    assert not kv[[1, 2, 4, 6, 7]].any()


@given(cuts=st.lists(st.integers(min_value=1, max_value=3 * BS - 1), max_size=6))
def test_chunked_spans_match_block_page(cuts: list[int]) -> None:
    lay = make_layout()
    model = SyntheticModel(lay)
    kv = allocate_kv(lay)
    tokens = seq_tokens(3 * BS)
    blocks = [2, 6, 1]
    write_chunked(model, kv, tokens, blocks, sorted(set(cuts)))
    for i, block in enumerate(blocks):
        assert model.verify(kv, block, content(i, tokens))


def test_partial_span_writes_only_its_offsets() -> None:
    lay = make_layout()
    model = SyntheticModel(lay)
    kv = allocate_kv(lay)
    tokens = seq_tokens(2 * BS)
    # positions 2 .. 5: the end of block 0 and the start of block 1
    model.write(kv, WriteSpan(1, 2, tokens[2:6], [4, 7], PARENTS[:2]))
    page0 = kv[4].view(lay.page_shape)
    page1 = kv[7].view(lay.page_shape)
    full0 = model.block_page(content(0, tokens)).view(lay.page_shape)
    full1 = model.block_page(content(1, tokens)).view(lay.page_shape)
    assert not page0[:, :, :, :2].any()
    assert torch.equal(page0[:, :, :, 2:], full0[:, :, :, 2:])
    assert torch.equal(page1[:, :, :, :2], full1[:, :, :, :2])
    assert not page1[:, :, :, 2:].any()
    assert not model.verify(kv, 4, content(0, tokens))


def test_write_rejects_wrong_block_count() -> None:
    lay = make_layout()
    model = SyntheticModel(lay)
    kv = allocate_kv(lay)
    with pytest.raises(ValueError, match="touches 2 blocks"):
        model.write(kv, WriteSpan(0, 3, [1, 2], [0], [0]))
    with pytest.raises(ValueError, match="parent hashes"):
        model.write(kv, WriteSpan(0, 0, [1, 2], [0], []))
    with pytest.raises(ValueError, match="full block"):
        model.block_page(BlockContent(0, 0, (1, 2)))
    model.write(kv, WriteSpan(0, 5, [], [], []))  # an empty span is a no-op
    assert not kv.any()


def test_content_depends_on_each_input() -> None:
    model = SyntheticModel(make_layout())
    base = BlockContent(group=0, parent_hash=PARENTS[0], tokens=(1, 2, 3, 4))
    variants = [
        BlockContent(0, PARENTS[0] ^ 1, (1, 2, 3, 4)),
        BlockContent(0, PARENTS[0], (1, 2, 3, 5)),
        BlockContent(1, PARENTS[0], (1, 2, 3, 4)),
        BlockContent(0, PARENTS[0], (2, 1, 3, 4)),  # same tokens at other offsets
    ]
    page = model.block_page(base)
    for other in variants:
        assert not torch.equal(page, model.block_page(other)), other
    # each token's KV changes only where that token sits
    diff = page.view(model.layout.page_shape) != model.block_page(variants[1]).view(
        model.layout.page_shape
    )
    assert diff[:, :, :, 3].any() and not diff[:, :, :, :3].any()
    # deterministic across instances
    assert torch.equal(page, SyntheticModel(make_layout()).block_page(base))


def test_tensor_parallel_shards_are_head_slices() -> None:
    heads = 4
    full_layout = make_layout(kv_heads=heads)
    shard_layout = make_layout(kv_heads=heads // 2)
    full = SyntheticModel(full_layout, rank=0, tp_size=1)
    ranks = [SyntheticModel(shard_layout, rank=r, tp_size=2) for r in range(2)]
    tokens = seq_tokens(2 * BS)
    kv_full = allocate_kv(full_layout)
    kv_ranks = [allocate_kv(shard_layout) for _ in ranks]
    write_chunked(full, kv_full, tokens, [3, 1], cuts=[3])
    for model, kv in zip(ranks, kv_ranks, strict=True):
        write_chunked(model, kv, tokens, [3, 1], cuts=[5])
    for block in (3, 1):
        whole = kv_full[block].view(full_layout.page_shape)
        for r in range(2):
            part = whole[:, :, r * 2 : (r + 1) * 2].reshape(-1)
            assert torch.equal(kv_ranks[r][block], part)
    assert not torch.equal(kv_ranks[0][3], kv_ranks[1][3])


def test_rank_validation() -> None:
    with pytest.raises(ValueError, match="rank"):
        SyntheticModel(make_layout(), rank=2, tp_size=2)
    with pytest.raises(ValueError, match="tp_size"):
        SyntheticModel(make_layout(), rank=0, tp_size=0)


def filled_kv(model: SyntheticModel) -> torch.Tensor:
    kv = allocate_kv(model.layout)
    tokens = seq_tokens(4 * BS)
    write_chunked(model, kv, tokens, [0, 1, 2, 3], cuts=[6])
    return kv


# pinned: the digest must not change between runs, machines or torch versions
GOLDEN_CHECKSUM = 1165020310137865466


def test_checksum_is_pinned_and_deterministic() -> None:
    model = SyntheticModel(make_layout())
    kv = filled_kv(model)
    value = model.checksum(kv, [0, 1, 2, 3])
    assert 0 <= value < (1 << 61) - 1
    assert value == GOLDEN_CHECKSUM
    assert SyntheticModel(make_layout()).checksum(filled_kv(model), [0, 1, 2, 3]) == value
    assert model.checksum(kv, []) == 0


def test_checksum_depends_on_content_not_block_ids() -> None:
    model = SyntheticModel(make_layout())
    kv = filled_kv(model)
    moved = kv.clone()
    moved[[5, 6]] = kv[[0, 1]]
    assert model.checksum(moved, [5, 6]) == model.checksum(kv, [0, 1])


def test_checksum_sensitive_to_one_element_and_order() -> None:
    model = SyntheticModel(make_layout())
    kv = filled_kv(model)
    blocks = [0, 1, 2, 3]
    base = model.checksum(kv, blocks)
    assert model.checksum(kv, [1, 0, 2, 3]) != base
    assert model.checksum(kv, [0, 1, 2]) != base
    bits = kv.view(torch.int16)
    for block, elem in [(0, 0), (2, 57), (3, model.layout.page_elems - 1)]:
        flipped = kv.clone()
        flipped.view(torch.int16)[block, elem] = bits[block, elem] ^ 1
        assert model.checksum(flipped, blocks) != base
        assert not model.verify(flipped, block, content_of(block))
    # positive and negative zero compare equal as floats but differ as bytes
    zeros = kv.clone()
    zeros[0, 0] = 0.0
    negzeros = zeros.clone()
    negzeros[0, 0] = -0.0
    assert model.checksum(zeros, blocks) != model.checksum(negzeros, blocks)


def content_of(block: int) -> BlockContent:
    return content(block, seq_tokens(4 * BS))


def test_checksum_independent_of_batching(monkeypatch: pytest.MonkeyPatch) -> None:
    import raykv.model.synthetic as model_module

    model = SyntheticModel(make_layout())
    kv = filled_kv(model)
    blocks = [3, 0, 2, 2, 1]
    whole = model.checksum(kv, blocks)
    # one page per batch, then two: the digest must not see the batch boundaries
    for pages in (1, 2):
        monkeypatch.setattr(model_module, "_CHECKSUM_BATCH_ELEMS", pages * model.layout.page_elems)
        assert model.checksum(kv, blocks) == whole
