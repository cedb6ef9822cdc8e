"""The plugin's tests run on a tiny random Llama-shaped model assembled from core blocks.

The model comes from a test-only plugin defined here, so these tests need no
architecture plugin installed: just core and this package.
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
from minisgl.testing.models import save_tiny_model


class TinyTestLM(CausalLM):
    """A Llama-shaped model built from core blocks only."""

    def make_layer(self, layer_id: int) -> nn.Module:
        cfg, ctx = self.config, self.ctx
        kw = {"tp": ctx.tp, "comm": ctx.comm, "dtype": ctx.dtype, "device": ctx.device}
        attn = AttentionBlock(cfg, layer_id, rotary=self.rotary, **kw)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, **kw)
        return DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype=ctx.dtype, device=ctx.device)


def _test_models_plugin() -> types.ModuleType:
    module = types.ModuleType("radix_test_models")

    @hookimpl
    def minisgl_models():  # type: ignore[no-untyped-def]
        return [ModelSpec(name="LlamaForCausalLM", factory=TinyTestLM)]

    module.minisgl_models = minisgl_models  # type: ignore[attr-defined]
    return module


def _registry(*names: str) -> PluginRegistry:
    extra = [PluginSource("radix-test-models", _test_models_plugin())]
    return load_plugins(only=[*names, "radix-test-models"], extra=extra, environ={})


@pytest.fixture(scope="session")
def registry() -> PluginRegistry:
    """Core built-ins, this plugin (through its installed entry point) and the test model."""
    return _registry("builtin", "radix")


@pytest.fixture(scope="session")
def core_only_registry() -> PluginRegistry:
    return _registry("builtin")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("LlamaForCausalLM", path)
    return path


@pytest.fixture
def make_llm(tiny_dir: Path, registry: PluginRegistry) -> Iterator:
    """Build LLMs on the tiny model (float32); after the test, every KV page must be accounted for."""
    made: list[LLM] = []

    def build(**kwargs) -> LLM:  # type: ignore[no-untyped-def]
        kwargs.setdefault("dtype", "float32")
        llm = LLM(str(tiny_dir), registry=registry, **kwargs)
        made.append(llm)
        return llm

    yield build
    for llm in made:
        llm.check_accounting()
        assert llm.kv_pages_in_use == 0
        assert llm.scheduler.kv.cache.protected_size == 0, "a finished run left a prefix locked"
        llm.close()
