"""Self-attention with rotary embedding over the paged KV cache, and what a forward pass is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core import Batch
from ..distributed import Communicator, TPInfo
from ..kernel import KernelSet, select_kernels
from .linear import QKVParallelLinear, RowParallelLinear
from .norm import RMSNorm
from .quant import QuantMethod
from .rotary import RotaryEmbedding

if TYPE_CHECKING:  # the backend is built above this floor; layers only call it
    from ..attention import BaseAttnBackend


@dataclass
class ForwardContext:
    """The batch being run and the attention backend to run it with, passed explicitly."""

    batch: Batch
    attn: BaseAttnBackend


class AttentionBlock(nn.Module):
    """q/k/v projection, optional per-head q/k RMSNorm (Qwen3), rope, attention, output projection.

    Reads ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` (default hidden /
    heads) and ``rms_norm_eps`` from ``config``. ``qkv_bias``: biases on q/k/v (Qwen2); ``qk_norm``: per-head
    RMSNorm of q and k, with ``norm_offset`` as :class:`~minisgl.layers.RMSNorm`'s ``offset``; ``rotary``: the
    model's shared :class:`~minisgl.layers.RotaryEmbedding`.
    """

    def __init__(
        self,
        config: Any,
        layer_id: int,
        *,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        norm_offset: float = 0.0,
        rotary: RotaryEmbedding,
        tp: TPInfo,
        comm: Communicator,
        dtype: torch.dtype,
        device: torch.device,
        kernels: KernelSet | None = None,
        quant: QuantMethod | None = None,
    ):
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device, "kernels": kernels or select_kernels(device, dtype)}
        lin: dict[str, Any] = {**kw, "quant": quant}  # the projections' weights follow the quantization method
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = head_dim = getattr(config, "head_dim", None) or hidden // heads
        self.layer_id = layer_id
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads, qkv_bias, tp=tp, **lin)
        self.num_heads, self.num_kv_heads = self.qkv_proj.local_heads, self.qkv_proj.local_kv_heads
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, False, tp=tp, comm=comm, **lin)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, offset=norm_offset, **kw) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, offset=norm_offset, **kw) if qk_norm else None
        self.rotary = rotary  # shared by every layer: one cos/sin table per model

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        qk_norm = (self.q_norm, self.k_norm) if self.q_norm is not None and self.k_norm is not None else None
        q, k = self.rotary(positions, q, k, qk_norm)
        # v stays a strided slice of qkv: backends store it through the pool, which reads rows in place.
        out = ctx.attn.forward(q.reshape(-1, q_size), k.reshape(-1, kv_size), v, self.layer_id, ctx.batch)
        return self.o_proj(out)
