"""The native rope through the rotary layer: factors of unchanged positions only, column-major input,
partial rotary (Phi-3) against transformers."""

from __future__ import annotations

import pytest
import torch
from minisgl_plugin_cpu.kernels import NativeCPUKernels
from minisgl_plugin_cpu.native import load_cpu_kernels

from minisgl.kernel import KernelSet, rms_norm
from minisgl.layers import RMSNorm, RotaryEmbedding, rope_parameters


def _native() -> NativeCPUKernels:
    lib = load_cpu_kernels()
    if lib is None:
        pytest.skip("the native CPU kernels are unavailable here")
    return NativeCPUKernels(lib)


def _rope(kernels: KernelSet, head_dim: int = 64, params: dict | None = None) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, 512, params or {"rope_theta": 10000.0, "rope_type": "default"}, kernels=kernels)


def test_positions_edited_in_place_are_rotated_anew() -> None:
    native, plain = _rope(_native()), _rope(KernelSet())
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 5, 77, 300])
    q, k = torch.randn(4, 9, 64, generator=gen), torch.randn(4, 3, 64, generator=gen)
    for _ in range(2):
        for got, want in zip(native(positions, q, k), plain(positions.clone(), q, k), strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        positions.add_(1)  # same tensor, edited in place (as a reused graph buffer would be)


def test_column_major_input_gives_contiguous_head_dim() -> None:
    rope = _rope(_native())
    qkv = torch.randn(12 * 64, 4, generator=torch.Generator().manual_seed(1)).t()  # [4 tokens, 12 heads * 64]
    q, k = qkv[:, : 9 * 64].reshape(4, 9, 64), qkv[:, 9 * 64 :].reshape(4, 3, 64)
    positions = torch.tensor([3, 1, 4, 1])
    got_q, got_k = rope(positions, q, k)
    assert got_q.stride(-1) == 1 and got_k.stride(-1) == 1
    want_q, want_k = rope(positions.clone(), q.contiguous(), k.contiguous())
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_partial_rotary_matches_transformers(qk_norm: bool) -> None:
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    cfg = Phi3Config(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        partial_rotary_factor=0.5,
    )
    rope = _rope(_native(), 32, rope_parameters(cfg))
    gen = torch.Generator().manual_seed(2)
    positions = torch.tensor([0, 5, 77, 300, 511])
    q, k = torch.randn(5, 4, 32, generator=gen), torch.randn(5, 2, 32, generator=gen)
    norms = (RMSNorm(32), RMSNorm(32)) if qk_norm else None
    for n in norms or ():
        n.weight.data = 1 + 0.1 * torch.randn(32, generator=gen)
    got_q, got_k = rope(positions, q, k, norms)
    if norms is not None:
        q, k = rms_norm(q, norms[0].weight, norms[0].eps), rms_norm(k, norms[1].weight, norms[1].eps)
    cos, sin = Phi3RotaryEmbedding(cfg)(q, positions.view(1, -1))
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
