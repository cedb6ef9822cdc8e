"""The seams a model that differs from Llama in a few places uses: Gemma (1) from core blocks in a few lines
(norm offset, embedding scale, GeGLU, tied embeddings by its config's default), through the model kit against
transformers' GemmaForCausalLM; and the pieces on their own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from minisgl.layers import AttentionBlock, GatedMLP, RMSNorm
from minisgl.models import CausalLM, DecoderLayer, ModelContext
from minisgl.plugins import ModelSpec, PluginRegistry, PluginSource, hookimpl, load_plugins
from minisgl.testing.model_conformance import ModelConformance
from minisgl.testing.models import save_tiny_model, tiny_config
from minisgl.testing.registry import CoreBlocksLM


class GemmaForCausalLM(CausalLM):
    """Gemma: Llama's layers with ``(1 + weight)`` norms, a GeGLU MLP and the embedding scaled by sqrt(hidden)."""

    norm_offset = 1.0

    def embedding_scale(self) -> float:
        return float(self.config.hidden_size**0.5)

    def make_layer(self, layer_id: int) -> nn.Module:
        cfg, ctx = self.config, self.ctx
        kw: dict[str, Any] = {"dtype": ctx.dtype, "device": ctx.device, "kernels": ctx.kernels}
        attn = AttentionBlock(cfg, layer_id, rotary=self.rotary, tp=ctx.tp, comm=ctx.comm, **kw)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, tp=ctx.tp, comm=ctx.comm, **kw)
        return DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, norm_offset=self.norm_offset, **kw)


class GemmaPlugin:
    @hookimpl
    def minisgl_models(self) -> list[ModelSpec]:
        return [ModelSpec(name="GemmaForCausalLM", factory=GemmaForCausalLM)]


class TestGemma(ModelConformance):
    architecture = "GemmaForCausalLM"
    config_overrides = {"head_dim": 16}  # Gemma's default 256 is slow for a tiny model; nothing else changes
    provider = "gemma"
    page_sizes = (4,)

    def load_registry(self) -> PluginRegistry:
        return load_plugins(["builtin", "gemma"], extra=[PluginSource("gemma", GemmaPlugin(), "gemma-test", "1.0")])


def test_the_kit_keeps_each_architectures_defaults() -> None:
    gemma, llama = tiny_config("GemmaForCausalLM"), tiny_config("LlamaForCausalLM")
    assert gemma.tie_word_embeddings is True and gemma.hidden_act == "gelu_pytorch_tanh" and gemma.head_dim == 256
    assert llama.tie_word_embeddings is False
    assert tiny_config("GemmaForCausalLM", tie_word_embeddings=False).tie_word_embeddings is False  # overrides win


def test_a_llama_shaped_model_does_not_pass_for_gemma(tmp_path: Path) -> None:
    """Without the offset and the scale the logits differ: the seams are what makes Gemma match."""
    from minisgl import LLM
    from minisgl.testing.model_conformance import prefill_logits

    hf = save_tiny_model("GemmaForCausalLM", tmp_path, head_dim=16)
    prompt = [[5, 9, 100, 7, 42]]
    with torch.no_grad():
        want = hf(torch.tensor(prompt)).logits[0]

    def logits(model: Any) -> torch.Tensor:
        class Plugin:
            @hookimpl
            def minisgl_models(self) -> list[ModelSpec]:
                return [ModelSpec(name="GemmaForCausalLM", factory=model)]

        registry = load_plugins(["builtin", "g"], extra=[PluginSource("g", Plugin(), "g", "1.0")])
        with LLM(str(tmp_path), device="cpu", dtype="float32", registry=registry) as llm:
            return prefill_logits(llm, prompt)

    assert torch.allclose(logits(GemmaForCausalLM), want, atol=1e-4)
    assert not torch.allclose(logits(CoreBlocksLM), want, atol=1e-2)


def test_rmsnorm_offset_is_folded_in_at_load() -> None:
    norm = RMSNorm(4, 1e-6, offset=1.0, dtype=torch.float32)
    stored = torch.tensor([0.0, 0.5, -1.0, 2.0])
    norm.weight.weight_loader(norm.weight, stored)  # type: ignore[attr-defined]
    assert norm.weight.tolist() == [1.0, 1.5, 0.0, 3.0]
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + stored)
    torch.testing.assert_close(norm(x), want)
    plain = RMSNorm(4, 1e-6, dtype=torch.float32)
    plain.weight.weight_loader(plain.weight, stored)  # type: ignore[attr-defined]
    assert plain.weight.tolist() == stored.tolist()


def test_llama_shaped_models_scale_nothing() -> None:
    ctx = ModelContext(tiny_config("LlamaForCausalLM"), torch.float32, torch.device("cpu"))
    model = CoreBlocksLM(ctx)
    assert model.embed_scale == 1.0 and model.norm_offset == 0.0
    gemma = GemmaForCausalLM(ModelContext(tiny_config("GemmaForCausalLM", head_dim=16), torch.bfloat16, ctx.device))
    assert gemma.embed_scale == 8.0 and gemma.model.norm.offset == 1.0
    assert gemma.lm_head.weight is gemma.model.embed_tokens.weight  # tied: Gemma's config default


def test_unknown_activation_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"^unsupported activation 'relu2'; supported: silu, gelu, gelu_pytorch_tanh$"):
        GatedMLP(
            8,
            16,
            "relu2",
            tp=ModelContext(None, torch.float32, torch.device("cpu")).tp,
            comm=ModelContext(None, torch.float32, torch.device("cpu")).comm,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
