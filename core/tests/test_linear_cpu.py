"""``KernelSet.linear`` (PyTorch): the CPU float32 product formulation must equal ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.kernel import KernelSet, weight_major

linear = KernelSet().linear


@pytest.mark.parametrize("rows", [0, 1, 2, 8, 15, 16, 40, 256, 257, 600])
@pytest.mark.parametrize("out_features", [48, 20_000])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows: int, out_features: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(out_features, 96, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    got = linear(x, w, b)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_linear_keeps_leading_dims_and_noncontiguous_input() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 96, 8, generator=gen).transpose(1, 2)  # [4, 8, 96], not contiguous: 32 rows
    w = torch.randn(40, 96, generator=gen)
    got = linear(x, w)
    assert got.shape == (4, 8, 40)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got.reshape(32, 40), F.linear(x.reshape(32, 96), w), atol=1e-4, rtol=1e-5)


def testweight_major_rule() -> None:
    assert not weight_major(1)  # a matrix-vector product either way
    assert weight_major(2) and weight_major(8) and weight_major(16) and weight_major(256)
    assert not weight_major(257)  # prefill-sized: F.linear


def test_linear_other_dtypes_unchanged() -> None:
    x, w = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(16, 64, dtype=torch.bfloat16)
    assert torch.equal(linear(x, w), F.linear(x, w))


def test_few_rows_give_row_major_output_from_any_input_layout() -> None:
    """Below 16 rows the next layer's GEMM and row-wise ops are much slower on a column-major tensor."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(96, 8, generator=gen).t(), torch.randn(40, 96, generator=gen)  # x column-major
    got = linear(x, w)
    assert got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-5)
