"""Llama: pre-norm decoder layers of rotary attention and a SwiGLU MLP."""

from __future__ import annotations

from typing import Any

from torch import nn

from minisgl.layers import AttentionBlock, GatedMLP
from minisgl.models import CausalLM, DecoderLayer


class LlamaForCausalLM(CausalLM):
    """Also the base of the other dense architectures, which differ only in these flags."""

    qkv_bias: bool = False  # Qwen2 has biases on q/k/v
    qk_norm: bool = False  # Qwen3 normalises q and k per head

    def make_layer(self, layer_id: int) -> nn.Module:
        cfg, ctx = self.config, self.ctx
        layer_kw: dict[str, Any] = {"dtype": ctx.dtype, "device": ctx.device, "kernels": ctx.kernels}
        kw: dict[str, Any] = {"tp": ctx.tp, "comm": ctx.comm, "quant": ctx.quant, **layer_kw}
        attn = AttentionBlock(
            cfg,
            layer_id,
            qkv_bias=self.qkv_bias or bool(getattr(cfg, "attention_bias", False)),
            qk_norm=self.qk_norm,
            norm_offset=self.norm_offset,
            rotary=self.rotary,
            **kw,
        )
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "hidden_act", "silu"), **kw)
        return DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, norm_offset=self.norm_offset, **layer_kw)
