"""The CPU rope paths (PyTorch, and the native kernel where it builds): rotation factors reused across
layers, layouts the attention kernels need."""

from __future__ import annotations

import pytest
import torch

from minisgl.kernel import KernelSet, NativeCPUKernels, select_kernels
from minisgl.layers.rotary import RotaryEmbedding


def _reference(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate-half rope in float64, computed from scratch (the table is float32: about 1e-5 off at position 300)."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = positions.double().view(-1, 1) * inv
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rope(path: str) -> RotaryEmbedding:
    kernels = KernelSet() if path == "torch" else select_kernels("cpu", torch.float32)
    if path == "native" and not isinstance(kernels, NativeCPUKernels):
        pytest.skip("the native CPU kernels are unavailable here")
    return RotaryEmbedding(64, 512, {"rope_theta": 10000.0, "rope_type": "default"}, kernels=kernels)


@pytest.mark.parametrize("path", ["torch", "native"])
def test_rope_matches_reference_and_reuses_factors_only_for_unchanged_positions(path: str) -> None:
    rope = _rope(path)
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 5, 77, 300])
    q, k = torch.randn(4, 9, 64, generator=gen), torch.randn(4, 3, 64, generator=gen)
    for _ in range(2):  # the second call reuses the factors looked up by the first
        got_q, got_k = rope(positions, q, k)
        torch.testing.assert_close(got_q.double(), _reference(q, positions), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_k.double(), _reference(k, positions), atol=1e-4, rtol=1e-4)
    positions.add_(1)  # same tensor, edited in place (as a reused graph buffer would be)
    got_q, _ = rope(positions, q, k)
    torch.testing.assert_close(got_q.double(), _reference(q, positions), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", ["torch", "native"])
def test_rope_output_has_contiguous_head_dim_for_column_major_input(path: str) -> None:
    """A weight-major GEMM leaves q/k column-major; SDPA on CPU needs head_dim contiguous for its fast kernel."""
    rope = _rope(path)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(12 * 64, 4, generator=gen).t()  # [4 tokens, 12 heads * 64], column-major
    q, k = qkv[:, : 9 * 64].reshape(4, 9, 64), qkv[:, 9 * 64 :].reshape(4, 3, 64)
    assert q.stride(-1) != 1
    positions = torch.tensor([3, 1, 4, 1])
    got_q, got_k = rope(positions, q, k)
    assert got_q.stride(-1) == 1 and got_k.stride(-1) == 1
    want_q, want_k = rope(positions.clone(), q.contiguous(), k.contiguous())
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
