"""Rotary position embedding (the "rotate half" form used by Llama and Qwen)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..kernel import KernelSet, select_kernels
from .norm import RMSNorm


def rope_parameters(config: Any) -> dict[str, Any]:
    """Rope settings from a Hugging Face config, across config styles (old and new)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params["rope_type"] or "default"
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type '{kind}'; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table indexed by position, shared by every layer of a model."""

    def __init__(
        self, head_dim: int, max_position: int, params: dict[str, Any], *, device=None, kernels: KernelSet | None = None
    ):
        super().__init__()
        self.head_dim = head_dim
        inv = inverse_frequencies(head_dim, params).to(device)
        t = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv)
        self.cos_sin: torch.Tensor
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
        self.kernels = kernels or select_kernels(device, torch.float32)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q``: ``[tokens, heads, head_dim]``, ``k``: ``[tokens, kv_heads, head_dim]``; with ``qk_norm``
        each head is first normalised by those RMSNorm layers. Returns new tensors."""
        norms = None if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)
        return self.kernels.rope(positions, q, k, self.cos_sin, norms)
