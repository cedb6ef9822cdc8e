"""A plugin registry with a test model built from core blocks only.

Tests of the core, and of plugins that are not model plugins (a prefix cache,
an attention kernel), need a model without depending on an architecture
plugin. :func:`registry_with_test_model` loads the named installed plugins plus
a test-only plugin that registers :class:`CoreBlocksLM` as ``LlamaForCausalLM``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from torch import nn

from ..layers import AttentionBlock, GatedMLP
from ..models import CausalLM, DecoderLayer
from ..plugins import ModelSpec, PluginRegistry, PluginSource, hookimpl, load_plugins

TEST_MODELS_PLUGIN = "minisgl-test-models"


class CoreBlocksLM(CausalLM):
    """A Llama-shaped model assembled from the core's public blocks, as an architecture plugin would."""

    def make_layer(self, layer_id: int) -> nn.Module:
        cfg, ctx = self.config, self.ctx
        attn = AttentionBlock(
            cfg, layer_id, rotary=self.rotary, tp=ctx.tp, comm=ctx.comm, dtype=ctx.dtype, device=ctx.device
        )
        mlp = GatedMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.hidden_act,
            tp=ctx.tp,
            comm=ctx.comm,
            dtype=ctx.dtype,
            device=ctx.device,
        )
        return DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype=ctx.dtype, device=ctx.device)


def _test_models_plugin() -> types.ModuleType:
    module = types.ModuleType("minisgl_test_models")

    @hookimpl
    def minisgl_models() -> list[ModelSpec]:
        return [ModelSpec(name="LlamaForCausalLM", factory=CoreBlocksLM)]

    module.minisgl_models = minisgl_models  # type: ignore[attr-defined]
    return module


def registry_with_test_model(*entry_names: str, environ: Mapping[str, str] | None = None) -> PluginRegistry:
    """The installed plugins ``entry_names`` (e.g. "builtin", "radix") plus the test model."""
    extra = [PluginSource(TEST_MODELS_PLUGIN, _test_models_plugin())]
    return load_plugins(only=[*entry_names, TEST_MODELS_PLUGIN], extra=extra, environ=environ)
