"""The MoE building blocks: routing, the ``torch`` backend, expert weight loading and tensor-parallel sharding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.distributed import TPInfo
from minisgl.moe import MoEExperts, SparseMoEBlock, expert_weight_target, route
from minisgl.moe.torch_backend import TorchMoEBackend


def loop_moe(x, w13, w2, weights, ids) -> torch.Tensor:  # noqa: ANN001
    """The definition, one (token, expert) pair at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def random_moe(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int = 0):  # noqa: ANN201
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, : experts // 4] -= 100.0  # the first quarter of the experts receives no token
    weights, ids = route(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (7, 8, 1), (33, 16, 4), (64, 8, 6), (5, 32, 8)])
def test_torch_backend_matches_per_expert_loop(tokens: int, experts: int, top_k: int) -> None:
    x, w13, w2, weights, ids = random_moe(tokens, experts, top_k, hidden=48, inter=24, seed=tokens)
    assert not torch.isin(ids, torch.arange(experts // 4)).any()  # some experts really are idle
    got = TorchMoEBackend().forward(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, loop_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_torch_backend_empty_batch() -> None:
    x, w13, w2, weights, ids = random_moe(0, 8, 2, hidden=16, inter=8)
    assert TorchMoEBackend().forward(x, w13, w2, weights, ids).shape == (0, 16)


def test_route_top_k_and_renormalisation() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids[0].tolist() == [1, 2]
    torch.testing.assert_close(weights[0], probs[0, [1, 2]])
    norm, norm_ids = route(logits, 2, renormalize=True)
    assert torch.equal(norm_ids, ids)
    torch.testing.assert_close(norm.sum(-1), torch.ones(2))
    torch.testing.assert_close(norm[1], torch.tensor([0.5, 0.5]))
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64


def test_expert_weight_names() -> None:
    assert expert_weight_target("model.layers.3.mlp.experts.17.gate_proj.weight") == (
        "model.layers.3.mlp.experts.w13_weight",
        ("gate", 17),
    )
    assert expert_weight_target("model.layers.3.mlp.experts.0.up_proj.weight") == (
        "model.layers.3.mlp.experts.w13_weight",
        ("up", 0),
    )
    assert expert_weight_target("model.layers.3.mlp.experts.2.down_proj.weight") == (
        "model.layers.3.mlp.experts.w2_weight",
        ("down", 2),
    )
    assert expert_weight_target("model.layers.0.mlp.experts.gate_up_proj") == (
        "model.layers.0.mlp.experts.w13_weight",
        ("gate_up", None),
    )
    assert expert_weight_target("model.layers.0.mlp.experts.down_proj") == (
        "model.layers.0.mlp.experts.w2_weight",
        ("down", None),
    )
    assert expert_weight_target("model.layers.0.mlp.gate_proj.weight") is None  # dense MLP
    assert expert_weight_target("model.layers.0.mlp.gate.weight") is None  # router


def per_expert_checkpoint(w13: torch.Tensor, w2: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    inter = w2.shape[2]
    out = []
    for e in range(w13.shape[0]):
        out += [
            (f"x.experts.{e}.gate_proj.weight", w13[e, :inter]),
            (f"x.experts.{e}.up_proj.weight", w13[e, inter:]),
            (f"x.experts.{e}.down_proj.weight", w2[e]),
        ]
    return out


def fused_checkpoint(w13: torch.Tensor, w2: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [("x.experts.gate_up_proj", w13), ("x.experts.down_proj", w2)]


def load(experts: MoEExperts, checkpoint: list[tuple[str, torch.Tensor]]) -> None:
    params = dict(experts.named_parameters())
    for name, tensor in checkpoint:
        target, shard = expert_weight_target(name)  # type: ignore[misc]
        param = params[target.removeprefix("x.experts.")]
        param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]


@pytest.mark.parametrize("layout", [per_expert_checkpoint, fused_checkpoint], ids=["per-expert", "fused"])
def test_both_checkpoint_layouts_load_the_same_weights(layout) -> None:  # noqa: ANN001
    x, w13, w2, weights, ids = random_moe(9, 8, 2, hidden=32, inter=16)
    experts = MoEExperts(8, 32, 16)
    assert len(experts.missing_weights()) == 24
    load(experts, layout(w13, w2))
    assert experts.missing_weights() == []
    assert torch.equal(experts.w13_weight, w13) and torch.equal(experts.w2_weight, w2)
    torch.testing.assert_close(experts(x, weights, ids), loop_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [per_expert_checkpoint, fused_checkpoint], ids=["per-expert", "fused"])
def test_tensor_parallel_shards_sum_to_the_full_layer(layout) -> None:  # noqa: ANN001
    """Each rank holds a column slice of gate/up and the matching row slice of down; partial outputs add up."""
    x, w13, w2, weights, ids = random_moe(11, 8, 3, hidden=32, inter=16, seed=4)
    full = loop_moe(x, w13, w2, weights, ids)
    partials = []
    for rank in range(2):
        experts = MoEExperts(8, 32, 16, tp=TPInfo(rank, 2))
        assert experts.w13_weight.shape == (8, 16, 32) and experts.w2_weight.shape == (8, 32, 8)
        load(experts, layout(w13, w2))
        lo = rank * 8
        assert torch.equal(experts.w13_weight[:, :8], w13[:, lo : lo + 8])  # this rank's gate rows
        assert torch.equal(experts.w13_weight[:, 8:], w13[:, 16 + lo : 16 + lo + 8])  # and its up rows
        assert torch.equal(experts.w2_weight, w2[:, :, lo : lo + 8])
        partials.append(experts(x, weights, ids))  # one-rank communicator: the partial sum itself
    torch.testing.assert_close(partials[0] + partials[1], full, rtol=1e-5, atol=1e-5)


def test_expert_loader_errors() -> None:
    experts = MoEExperts(4, 32, 16)
    p = experts.w13_weight
    with pytest.raises(ValueError, match=r"expert 1 gate_proj has shape \(32, 32\), expected \(16, 32\)"):
        experts.load_weight(p, torch.zeros(32, 32), ("gate", 1))
    with pytest.raises(ValueError, match="checkpoint has expert 4, but the model has 4 experts"):
        experts.load_weight(p, torch.zeros(16, 32), ("up", 4))
    with pytest.raises(ValueError, match=r"experts.gate_up_proj has shape \(4, 32, 16\), expected \(4, 32, 32\)"):
        experts.load_weight(p, torch.zeros(4, 32, 16), ("gate_up", None))
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 3"):
        MoEExperts(4, 32, 16, tp=TPInfo(0, 3))
    experts.load_weight(p, torch.zeros(16, 32), ("gate", 0))
    assert experts.missing_weights()[:3] == ["expert 0 up_proj", "expert 0 down_proj", "expert 1 gate_proj"]


def test_sparse_block_matches_transformers() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    for norm in (True, False):
        cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
                             norm_topk_prob=norm)  # fmt: skip
        ref = Qwen3MoeSparseMoeBlock(cfg)
        with torch.no_grad():
            for p in ref.parameters():
                p.normal_(0, 0.3)
        block = SparseMoEBlock(32, 16, 8, 3, renormalize=norm)
        block.gate.weight.data.copy_(ref.gate.weight)
        load(block.experts, fused_checkpoint(ref.experts.gate_up_proj.data, ref.experts.down_proj.data))
        x = torch.randn(2, 13, 32)
        with torch.no_grad():
            torch.testing.assert_close(block(x.reshape(-1, 32)), ref(x).reshape(-1, 32), rtol=1e-5, atol=1e-5)


def test_top_k_must_fit_the_experts() -> None:
    with pytest.raises(ValueError, match=r"top-k \(9\) must be between 1 and the number of experts \(8\)"):
        SparseMoEBlock(32, 16, 8, 9, renormalize=True)
