"""The model conformance kit on a model plugin the core does not ship: Phi-3, written as an outside author
would (fused qkv_proj and gate_up_proj checkpoint tensors, partial rotary), in ten lines of model code; and
broken variants of it that the kit must reject."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from minisgl.layers import AttentionBlock, GatedMLP, RotaryEmbedding
from minisgl.models import CausalLM, DecoderLayer
from minisgl.plugins import ModelSpec, PluginRegistry, PluginSource, hookimpl, load_plugins
from minisgl.testing.model_conformance import ModelConformance


class Phi3ForCausalLM(CausalLM):
    """Phi-3: Llama's layers; its checkpoint stores qkv_proj and gate_up_proj already fused."""

    def make_layer(self, layer_id: int) -> nn.Module:
        cfg, ctx = self.config, self.ctx
        kw: dict[str, Any] = {"dtype": ctx.dtype, "device": ctx.device, "kernels": ctx.kernels}
        attn = AttentionBlock(cfg, layer_id, rotary=self.rotary, tp=ctx.tp, comm=ctx.comm, **kw)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, tp=ctx.tp, comm=ctx.comm, **kw)
        return DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, **kw)


class Phi3Plugin:
    model: Any = Phi3ForCausalLM

    @hookimpl
    def minisgl_models(self) -> list[ModelSpec]:
        return [ModelSpec(name="Phi3ForCausalLM", factory=self.model)]


def registry_with(model: Any) -> PluginRegistry:
    plugin = Phi3Plugin()
    plugin.model = model
    return load_plugins(["builtin", "phi3"], extra=[PluginSource("phi3", plugin, "minisgl-plugin-phi3", "1.0")])


class TestPhi3PartialRotary(ModelConformance):
    architecture = "Phi3ForCausalLM"
    config_overrides = {"partial_rotary_factor": 0.5, "pad_token_id": 0}  # head_dim 16: 8 dims rotate
    provider = "phi3"

    def load_registry(self) -> PluginRegistry:
        return registry_with(Phi3ForCausalLM)


class TestPhi3FullRotary(TestPhi3PartialRotary):
    config_overrides = {"pad_token_id": 0}
    page_sizes = (16,)


def test_tiny_phi3_has_what_the_kit_is_meant_to_exercise(tmp_path: Path) -> None:
    """The checkpoint stores fused tensors, the factor sits where transformers 5 puts it, and the engine
    rotates 8 of 16 head dims."""
    from safetensors.torch import load_file

    model = TestPhi3PartialRotary.build_tiny_model(tmp_path)
    assert model.hf_model.config.rope_parameters["partial_rotary_factor"] == 0.5
    names = load_file(str(tmp_path / "model.safetensors")).keys()
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    with TestPhi3PartialRotary().make_llm(model) as llm:
        rotary = llm.engine.model.rotary
        assert (rotary.head_dim, rotary.rotary_dim) == (16, 8)


# The kit must catch broken models, or passing it means nothing.


class _FullRotary(Phi3ForCausalLM):
    """Ignores partial_rotary_factor (what the core did before): rotates the whole head."""

    def __init__(self, ctx: Any):
        super().__init__(ctx)
        cfg = self.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        params = {"rope_theta": cfg.rope_parameters["rope_theta"], "rope_type": "default"}
        full = RotaryEmbedding(head_dim, self.max_positions, params, device=ctx.device, kernels=ctx.kernels)
        self.rotary.cos_sin, self.rotary.rotary_dim = full.cos_sin, head_dim


class _TiesEmbeddings(Phi3ForCausalLM):
    """Ties the LM head to the embedding though the config does not (and skips the checkpoint's lm_head)."""

    def __init__(self, ctx: Any):
        super().__init__(ctx)
        self.tie_word_embeddings = True
        self.lm_head.weight = self.model.embed_tokens.weight


class _SwappedGateUp(Phi3ForCausalLM):
    """Loads the fused gate_up tensor with its halves swapped."""

    def load_weights(self, weights: Any) -> None:
        def swap(name: str, t: torch.Tensor) -> torch.Tensor:
            return torch.cat(t.chunk(2)[::-1]) if name.endswith("gate_up_proj.weight") else t

        super().load_weights((n, swap(n, t)) for n, t in weights)


@pytest.mark.parametrize("broken", [_FullRotary, _TiesEmbeddings, _SwappedGateUp], ids=lambda c: c.__name__)
def test_kit_rejects_broken_model(broken: type, tmp_path: Path) -> None:
    class Kit(TestPhi3PartialRotary):
        def load_registry(self) -> PluginRegistry:
            return registry_with(broken)

    model = Kit.build_tiny_model(tmp_path)
    with pytest.raises(AssertionError, match=r"Phi3ForCausalLM, page size 16: the engine disagrees with transformers"):
        Kit().test_greedy_matches_transformers(model, 16)
