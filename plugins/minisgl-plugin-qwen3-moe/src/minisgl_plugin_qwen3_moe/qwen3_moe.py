"""Qwen3-MoE: Qwen3 attention (q/k RMSNorm) with sparse MoE blocks in place of the dense MLP.

A layer is sparse unless it is listed in ``mlp_only_layers`` or falls between
``decoder_sparse_step`` strides; dense layers use the usual gated MLP of
``intermediate_size``, sparse ones route each token to ``num_experts_per_tok``
of ``num_experts`` experts of ``moe_intermediate_size``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from minisgl.layers import AttentionBlock, GatedMLP
from minisgl.models import CausalLM, DecoderLayer
from minisgl.moe import MoEExperts, SparseMoEBlock, expert_weight_target


def is_sparse_layer(config: Any, layer_id: int) -> bool:
    """Whether decoder layer ``layer_id`` has a sparse MoE block (transformers' rule)."""
    if layer_id in (getattr(config, "mlp_only_layers", None) or []):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return config.num_experts > 0 and (layer_id + 1) % step == 0


class Qwen3MoeForCausalLM(CausalLM):
    def make_layer(self, layer_id: int) -> nn.Module:
        cfg, ctx = self.config, self.ctx
        layer_kw: dict[str, Any] = {"dtype": ctx.dtype, "device": ctx.device, "kernels": ctx.kernels}
        kw: dict[str, Any] = {"tp": ctx.tp, "comm": ctx.comm, **layer_kw}
        attn = AttentionBlock(
            cfg,
            layer_id,
            qkv_bias=bool(getattr(cfg, "attention_bias", False)),
            qk_norm=True,
            rotary=self.rotary,
            **kw,
        )
        act = getattr(cfg, "hidden_act", "silu")
        mlp: nn.Module
        if is_sparse_layer(cfg, layer_id):
            if act != "silu":
                raise ValueError(f"Qwen3-MoE experts support hidden_act 'silu' only, the config has '{act}'")
            mlp = SparseMoEBlock(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
                backend=ctx.moe_backend,
                quant=ctx.quant,
                **kw,
            )
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, act, **kw)
        return DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, **layer_kw)

    def map_weight_name(self, name: str) -> tuple[str, Any]:
        # Expert names first: the dense table would turn experts.N.gate_proj into a gate_up_proj shard.
        return expert_weight_target(name) or super().map_weight_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        for name, module in self.named_modules():
            if isinstance(module, MoEExperts) and (missing := module.missing_weights()):
                shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                raise KeyError(f"checkpoint is missing weights for {name}: {shown}")
