"""Rotary position embedding, the "rotate half" form (Llama, Qwen); with ``partial_rotary_factor`` < 1
(Phi-3) only the first ``int(head_dim * factor)`` dimensions of each head rotate, as in transformers."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..kernel import KernelSet, rms_norm, select_kernels
from .norm import RMSNorm

ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Any) -> dict[str, Any]:
    """Rope settings of a Hugging Face config, old style or new (``rope_parameters``, transformers 5); a
    setting the core cannot honour raises ``ValueError`` naming the model and the setting."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params.setdefault("rope_type", params.pop("type", "default"))
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(config, "partial_rotary_factor", None) or 1.0
    archs = getattr(config, "architectures", None) or []
    model = str(archs[0] if archs else getattr(config, "model_type", None) or type(config).__name__)
    kind = params["rope_type"] or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"{model}: unsupported rope scaling type '{kind}' (rope_parameters.rope_type); "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    head_dim = getattr(config, "head_dim", None)
    if not head_dim and getattr(config, "hidden_size", None) and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    if head_dim:
        rotary_dim(int(head_dim), params, model)  # validates the factor here, where the model has a name
    return params


def rotary_dim(head_dim: int, params: dict[str, Any], model: str = "this model") -> int:
    """How many leading dimensions of each head are rotated: ``int(head_dim * partial_rotary_factor)``."""
    factor = params.get("partial_rotary_factor")
    factor = 1.0 if factor is None else factor
    try:
        value = float(factor)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{model}: partial_rotary_factor must be in (0, 1], got {factor!r}")
    dim = int(head_dim * value)
    if dim < 2 or dim % 2:
        raise ValueError(
            f"{model}: partial_rotary_factor {factor} gives {dim} rotary dimensions of head_dim {head_dim}; "
            "rotate-half rope needs an even number of at least 2"
        )
    return dim


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
    raise ValueError(f"unsupported rope scaling type '{kind}'; supported: {', '.join(ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table indexed by position, shared by every layer of a model."""

    def __init__(
        self, head_dim: int, max_position: int, params: dict[str, Any], *, device=None, kernels: KernelSet | None = None
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(head_dim, params)
        inv = inverse_frequencies(self.rotary_dim, params).to(device)
        t = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv)
        self.cos_sin: torch.Tensor
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
        self.kernels = kernels or select_kernels(device, torch.float32)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, qk_norm: tuple[RMSNorm, RMSNorm] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New ``q`` ``[tokens, heads, head_dim]`` and ``k`` ``[tokens, kv_heads, head_dim]``, each head
        first normalised by ``qk_norm``'s RMSNorm layers if given."""
        norms = None if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)
        r = self.rotary_dim
        if r == self.head_dim:
            return self.kernels.rope(positions, q, k, self.cos_sin, norms)
        if norms is not None:  # over the whole head, before rope (as transformers does)
            q, k = rms_norm(q, norms[0], norms[2]), rms_norm(k, norms[1], norms[2])
        q_part, k_part = q[..., :r].contiguous(), k[..., :r].contiguous()
        q_rot, k_rot = self.kernels.rope(positions, q_part, k_part, self.cos_sin, None)
        return torch.cat([q_rot, q[..., r:].to(q_rot.dtype)], -1), torch.cat([k_rot, k[..., r:].to(k_rot.dtype)], -1)
