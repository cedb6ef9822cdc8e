"""Rotary position embedding (the "rotate half" form used by Llama and Qwen)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .. import kernel
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
    """Precomputed cos/sin table indexed by position; applied to q and k in place of a copy."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any], *, device=None):
        super().__init__()
        self.head_dim = head_dim
        inv = inverse_frequencies(head_dim, params).to(device)
        t = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv)
        self.cos_sin: torch.Tensor
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
        # On CUDA one Triton kernel rotates q and k (normalising them first for Qwen3's q/k norm).
        self._fused = kernel.qk_norm_rope_kernel() if kernel.enabled(device) else None
        # On CPU (float32) one C kernel does the same and writes q and k contiguous.
        self._cpu = kernel.cpu_kernels(device, torch.float32)
        # Elsewhere every layer rotates by the same positions: the factors are looked up once per
        # forward pass, keyed on that positions tensor (and its version, so in-place edits miss).
        self._factors: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q``: ``[tokens, heads, head_dim]``, ``k``: ``[tokens, kv_heads, head_dim]``.

        With ``qk_norm``, each head of q and k is first normalised by those RMSNorm layers.
        """
        if self._fused is not None:
            if qk_norm is None:
                return self._fused(q, k, self.cos_sin, positions)
            q_norm, k_norm = qk_norm
            return self._fused(q, k, self.cos_sin, positions, q_norm.weight, k_norm.weight, q_norm.eps)
        if self._cpu is not None and q.dtype == k.dtype == torch.float32 and _one_element_stride(q, k):
            norms = None if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)
            if norms is None or norms[0].dtype == norms[1].dtype == torch.float32:
                return self._cpu.rope(q, k, positions, self.cos_sin, norms)
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        cos, sin = self._rotation_factors(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _rotation_factors(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``([cos, cos], [-sin, sin])`` per position, ``[tokens, 1, head_dim]``, for :func:`_rotate`."""
        cached = self._factors
        if cached is not None and cached[0] is positions and cached[1] == positions._version:
            return cached[2], cached[3]
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        cos2, sin2 = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
        self._factors = (positions, positions._version, cos2, sin2)
        return cos2, sin2


def _one_element_stride(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether q and k are ``[T, heads, head_dim]`` views of one matrix (what the C kernel reads)."""
    step = q.stride(2)
    return k.stride(2) == step and q.stride(1) == q.shape[2] * step and k.stride(1) == k.shape[2] * step


def _rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope, ``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]``, in three elementwise ops.

    ``x.roll(half)`` is ``[x2, x1]``; with ``sin2 = [-sin, sin]`` this is the same float arithmetic.
    """
    x32 = x.float()
    if x32.stride(-1) != 1:
        # A weight-major CPU GEMM (layers.linear) leaves q and k column-major; elementwise ops keep
        # that layout, and attention kernels want head_dim contiguous (SDPA on CPU falls back to
        # its slow math path otherwise).
        x32 = x32.contiguous()
    out = x32 * cos2 + x32.roll(x.shape[-1] // 2, dims=-1) * sin2
    return out.to(x.dtype)
