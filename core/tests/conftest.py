"""Core tests run with the built-in plugin only, plus a test model defined here.

The model is assembled from core's public blocks exactly like an architecture
plugin would be, so the core is tested without any plugin package installed.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch import nn

from minisgl import LLM
from minisgl.layers import AttentionBlock, GatedMLP
from minisgl.models import CausalLM, DecoderLayer
from minisgl.plugins import ModelSpec, PluginRegistry, PluginSource, hookimpl, load_plugins
from minisgl.testing.models import save_tiny_model, save_word_tokenizer


class CoreTestLM(CausalLM):
    """A Llama-shaped model built from core blocks only."""

    def make_layer(self, layer_id: int) -> nn.Module:
        cfg, ctx = self.config, self.ctx
        kw = {"tp": ctx.tp, "comm": ctx.comm, "dtype": ctx.dtype, "device": ctx.device}
        attn = AttentionBlock(cfg, layer_id, rotary=self.rotary, **kw)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, **kw)
        return DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype=ctx.dtype, device=ctx.device)


def _test_models_plugin() -> types.ModuleType:
    module = types.ModuleType("core_test_models")

    @hookimpl
    def minisgl_models():  # type: ignore[no-untyped-def]
        return [ModelSpec(name="LlamaForCausalLM", factory=CoreTestLM)]

    module.minisgl_models = minisgl_models  # type: ignore[attr-defined]
    return module


@pytest.fixture(scope="session")
def registry() -> PluginRegistry:
    """Built-ins plus the test model, whatever else is installed."""
    return load_plugins(
        only=["builtin", "core-test-models"], extra=[PluginSource("core-test-models", _test_models_plugin())]
    )


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("LlamaForCausalLM", path)
    save_word_tokenizer(path, 512)
    return path


@pytest.fixture(scope="session")
def hf_model(tiny_dir: Path):  # noqa: ANN201 - a transformers model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


@pytest.fixture
def make_llm(tiny_dir: Path, registry: PluginRegistry) -> Iterator:
    """Build LLMs on the tiny model; after the test, every KV page must be back."""
    made: list[LLM] = []

    def build(**kwargs) -> LLM:  # type: ignore[no-untyped-def]
        kwargs.setdefault("page_size", 4)
        llm = LLM(str(tiny_dir), registry=registry, **kwargs)
        made.append(llm)
        return llm

    yield build
    for llm in made:
        llm.check_accounting()
        assert llm.kv_pages_in_use == 0
        llm.close()
