"""The decoder's matrix products (``raykv/model/linear.py``) equal ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raykv.model.linear import Linear


@pytest.mark.parametrize("rows", [1, 3, 8, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_product_equals_f_linear_in_float32(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 40, generator=gen)
    got = Linear(weight, bias)(x)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    assert torch.allclose(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_a_strided_input_and_bfloat16_weights() -> None:
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(64, 32, generator=gen)
    x = torch.randn(32, 5, generator=gen).t()  # not contiguous
    assert torch.allclose(Linear(weight)(x), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    w16, x16 = weight.to(torch.bfloat16), x.to(torch.bfloat16)
    got = Linear(w16)(x16)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), F.linear(x16, w16).float(), rtol=2e-2, atol=2e-2)
