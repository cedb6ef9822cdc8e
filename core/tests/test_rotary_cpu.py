"""The CPU rope path of the reference kernel set: rotation factors reused across layers, layouts the
attention kernels need, partial rotary (minisgl-plugin-cpu runs the same checks on its native set)."""

from __future__ import annotations

import pytest
import torch

from minisgl.kernel import KernelSet
from minisgl.layers.rotary import RotaryEmbedding


def _reference(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate-half rope in float64, computed from scratch (the table is float32: about 1e-5 off at position 300)."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = positions.double().view(-1, 1) * inv
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rope() -> RotaryEmbedding:
    return RotaryEmbedding(64, 512, {"rope_theta": 10000.0, "rope_type": "default"}, kernels=KernelSet())


def test_rope_matches_reference_and_reuses_factors_only_for_unchanged_positions() -> None:
    rope = _rope()
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


def test_rope_output_has_contiguous_head_dim_for_column_major_input() -> None:
    """A weight-major GEMM leaves q/k column-major; SDPA on CPU needs head_dim contiguous for its fast kernel."""
    rope = _rope()
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(12 * 64, 4, generator=gen).t()  # [4 tokens, 12 heads * 64], column-major
    q, k = qkv[:, : 9 * 64].reshape(4, 9, 64), qkv[:, 9 * 64 :].reshape(4, 3, 64)
    assert q.stride(-1) != 1
    positions = torch.tensor([3, 1, 4, 1])
    got_q, got_k = rope(positions, q, k)
    assert got_q.stride(-1) == 1 and got_k.stride(-1) == 1
    want_q, want_k = rope(positions.clone(), q.contiguous(), k.contiguous())
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


# Partial rotary (Phi-3, Phi-4-mini): only the first int(head_dim * factor) dimensions rotate.


def _phi3_config(**fields):  # type: ignore[no-untyped-def]
    from transformers import Phi3Config

    base = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
    return Phi3Config(**{**base, **fields})


@pytest.mark.parametrize("qk_norm", [False, True])
def test_partial_rotary_matches_transformers(qk_norm: bool) -> None:
    """The rotated part and the pass-through part equal transformers' Phi-3 rope (its apply_rotary_pos_emb)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    from minisgl.kernel import rms_norm
    from minisgl.layers import RMSNorm, rope_parameters

    cfg = _phi3_config(partial_rotary_factor=0.5)
    params = rope_parameters(cfg)
    assert params["partial_rotary_factor"] == 0.5
    rope = RotaryEmbedding(32, 512, params, kernels=KernelSet())
    assert rope.rotary_dim == 16
    gen = torch.Generator().manual_seed(2)
    positions = torch.tensor([0, 5, 77, 300, 511])
    q, k = torch.randn(5, 4, 32, generator=gen), torch.randn(5, 2, 32, generator=gen)
    norms = None
    if qk_norm:
        norms = (RMSNorm(32), RMSNorm(32))
        for n in norms:
            n.weight.data = 1 + 0.1 * torch.randn(32, generator=gen)
    got_q, got_k = rope(positions, q, k, norms)
    if norms is not None:
        q, k = rms_norm(q, norms[0].weight, norms[0].eps), rms_norm(k, norms[1].weight, norms[1].eps)
    cos, sin = Phi3RotaryEmbedding(cfg)(q, positions.view(1, -1))
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert torch.equal(got_q[..., 16:], q[..., 16:]) and torch.equal(got_k[..., 16:], k[..., 16:])


def test_partial_rotary_factor_read_from_root_and_rope_parameters() -> None:
    """transformers 5 moves the factor into rope_parameters; older configs keep it at the root."""
    from types import SimpleNamespace

    from minisgl.layers import rope_parameters

    assert rope_parameters(_phi3_config(partial_rotary_factor=0.75))["partial_rotary_factor"] == 0.75
    old_style = SimpleNamespace(hidden_size=128, num_attention_heads=4, rope_theta=1e4, partial_rotary_factor=0.5)
    assert rope_parameters(old_style)["partial_rotary_factor"] == 0.5
    new_style = SimpleNamespace(
        hidden_size=128, num_attention_heads=4, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25}
    )
    assert rope_parameters(new_style)["partial_rotary_factor"] == 0.25
    assert rope_parameters(SimpleNamespace(hidden_size=128, num_attention_heads=4))["partial_rotary_factor"] == 1.0


@pytest.mark.parametrize(
    ("factor", "message"),
    [
        (0.0, r"MyPhiForCausalLM: partial_rotary_factor must be in \(0, 1\], got 0.0"),
        (1.5, r"MyPhiForCausalLM: partial_rotary_factor must be in \(0, 1\], got 1.5"),
        (0.3, r"MyPhiForCausalLM: partial_rotary_factor 0.3 gives 9 rotary dimensions of head_dim 32"),
    ],
)
def test_partial_rotary_factor_that_cannot_be_honoured_is_refused(factor: float, message: str) -> None:
    from types import SimpleNamespace

    from minisgl.layers import rope_parameters

    cfg = SimpleNamespace(
        architectures=["MyPhiForCausalLM"],
        hidden_size=128,
        num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": factor},
    )
    with pytest.raises(ValueError, match=message):
        rope_parameters(cfg)


def test_unknown_rope_type_names_the_model() -> None:
    from types import SimpleNamespace

    from minisgl.layers import rope_parameters

    cfg = SimpleNamespace(model_type="phi3", hidden_size=64, num_attention_heads=4, rope_scaling={"type": "longrope"})
    with pytest.raises(ValueError, match=r"phi3: unsupported rope scaling type 'longrope'"):
        rope_parameters(cfg)
