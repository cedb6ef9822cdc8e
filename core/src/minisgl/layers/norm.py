"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernel
from .linear import default_loader, set_loader


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6, *, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        set_loader(self.weight, default_loader)
        # On CUDA one Triton kernel replaces the chain of elementwise ops (see minisgl.kernel).
        self._fused = kernel.rmsnorm_kernel() if kernel.enabled(device) else None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One op instead of a chain of six, with the same float32 arithmetic.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            return self._fused(x, self.weight, self.eps)
        return self._norm(x)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; with no residual yet, ``x`` starts it."""
        if self._fused is not None:
            if residual is None:
                return self._fused(x, self.weight, self.eps), x
            return self._fused(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        return self._norm(x), x
