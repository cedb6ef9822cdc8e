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


# Fused checkpoint tensors (Phi-3 stores qkv_proj and gate_up_proj already fused).


def test_whole_fused_tensors_load_like_their_parts() -> None:
    from minisgl.distributed import TPInfo
    from minisgl.layers import ColumnParallelLinear, QKVParallelLinear

    gen = torch.Generator().manual_seed(4)
    for tp in (TPInfo(), TPInfo(rank=1, size=2)):
        gate, up = torch.randn(24, 16, generator=gen), torch.randn(24, 16, generator=gen)
        a, b = ColumnParallelLinear(16, [24, 24], tp=tp), ColumnParallelLinear(16, [24, 24], tp=tp)
        a.weight.weight_loader(a.weight, gate, 0)
        a.weight.weight_loader(a.weight, up, 1)
        b.weight.weight_loader(b.weight, torch.cat([gate, up]))
        assert torch.equal(a.weight, b.weight)

        q, k, v = (torch.randn(n * 8, 16, generator=gen) for n in (4, 2, 2))
        bias = torch.randn(64, generator=gen)
        c, d = QKVParallelLinear(16, 8, 4, 2, True, tp=tp), QKVParallelLinear(16, 8, 4, 2, True, tp=tp)
        for sid, part, bpart in zip("qkv", (q, k, v), bias.split([32, 16, 16]), strict=True):
            c.weight.weight_loader(c.weight, part, sid)
            assert c.bias is not None
            c.bias.weight_loader(c.bias, bpart, sid)
        d.weight.weight_loader(d.weight, torch.cat([q, k, v]))
        assert d.bias is not None
        d.bias.weight_loader(d.bias, bias)
        assert torch.equal(c.weight, d.weight) and torch.equal(c.bias, d.bias)


def test_wrong_sized_fused_tensor_says_what_to_do() -> None:
    from minisgl.layers import ColumnParallelLinear, QKVParallelLinear

    mlp = ColumnParallelLinear(16, [24, 24])
    with pytest.raises(
        ValueError, match=r"blocks \[24, 24\] got a tensor of shape \(40, 16\) and no shard_id.*stacked_params"
    ):
        mlp.weight.weight_loader(mlp.weight, torch.zeros(40, 16))
    qkv = QKVParallelLinear(16, 8, 4, 2)
    with pytest.raises(ValueError, match=r"q 32, k 16, v 16 rows\) got a tensor of shape \(32, 16\).*shard_id 'q'"):
        qkv.weight.weight_loader(qkv.weight, torch.zeros(32, 16))


def test_load_weights_error_names_checkpoint_tensor_and_parameter() -> None:
    """A tensor that does not fit names the checkpoint tensor, the parameter, and what to do."""
    from types import SimpleNamespace

    from torch import nn

    from minisgl.layers import GatedMLP
    from minisgl.models import CausalLM, ModelContext

    class Tiny(CausalLM):
        def make_layer(self, layer_id: int) -> nn.Module:
            kw = {"tp": self.ctx.tp, "comm": self.ctx.comm, "dtype": torch.float32, "device": torch.device("cpu")}
            return nn.ModuleDict({"mlp": GatedMLP(16, 24, "silu", **kw)})

    cfg = SimpleNamespace(
        architectures=["Tiny"],
        vocab_size=32,
        hidden_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
    )
    model = Tiny(ModelContext(cfg, torch.float32, torch.device("cpu")))
    bad = ("model.layers.0.mlp.gate_up_proj.weight", torch.zeros(40, 16))
    with pytest.raises(
        ValueError,
        match=r"checkpoint tensor 'model.layers.0.mlp.gate_up_proj.weight' \(40, 16\) does not load into parameter "
        r"'model.layers.0.mlp.gate_up_proj.weight' \(48, 16\) of Tiny: .*whole fused tensor \(48 rows",
    ):
        model.load_weights([bad])
    with pytest.raises(
        KeyError,
        match=r"'model.layers.0.mlp.gate_up.weight' has no matching parameter in Tiny "
        r"\(closest: 'model.layers.0.mlp.gate_up_proj.weight'\)",
    ):
        model.load_weights([("model.layers.0.mlp.gate_up.weight", torch.zeros(48, 16))])


def test_a_parameter_under_two_names_loads_from_either_and_is_then_complete() -> None:
    """A quantization method may register one scale under each name checkpoints give it (``weight_scale_inv`` and
    ``weight_scale``): loading either name fills it, and only a parameter loaded under no name is missing."""
    from types import SimpleNamespace

    from torch import nn

    from minisgl.layers import RowParallelLinear
    from minisgl.models import CausalLM, ModelContext

    class Aliased(CausalLM):
        def make_layer(self, layer_id: int) -> nn.Module:
            kw = {"tp": self.ctx.tp, "comm": self.ctx.comm, "dtype": torch.float32, "device": torch.device("cpu")}
            proj = RowParallelLinear(16, 16, **kw)
            proj.register_parameter("alias", proj.weight)
            return nn.ModuleDict({"proj": proj})

    cfg = SimpleNamespace(
        architectures=["Aliased"], vocab_size=32, hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
        rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    others = [("model.embed_tokens.weight", torch.zeros(32, 16)), ("model.norm.weight", torch.ones(16))]
    others.append(("lm_head.weight", torch.zeros(32, 16)))
    for name in ("weight", "alias"):
        model = Aliased(ModelContext(cfg, torch.float32, torch.device("cpu")))
        model.load_weights([*others, (f"model.layers.0.proj.{name}", torch.full((16, 16), 2.0))])
        assert model.model.layers[0]["proj"].weight.eq(2.0).all()
    model = Aliased(ModelContext(cfg, torch.float32, torch.device("cpu")))
    with pytest.raises(KeyError, match=r"missing weights for: model.layers.0.proj.weight"):
        model.load_weights(others)
