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
        # On CUDA one Triton kernel replaces the chain of elementwise ops, on CPU one C kernel
        # (see minisgl.kernel).
        self._fused = kernel.rmsnorm_kernel() if kernel.enabled(device) else None
        self._cpu = kernel.cpu_kernels(device, self.weight.dtype)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One op instead of a chain of six, with the same float32 arithmetic.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def _cpu_ok(self, x: torch.Tensor) -> bool:
        return self._cpu is not None and x.dim() == 2 and x.dtype == torch.float32 and 1 in x.stride()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            return self._fused(x, self.weight, self.eps)
        if self._cpu_ok(x):
            return self._cpu.rmsnorm(x, self.weight, self.eps)[0]
        return self._norm(x)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; with no residual yet, ``x`` starts it."""
        if self._fused is not None:
            if residual is None:
                return self._fused(x, self.weight, self.eps), x
            return self._fused(x, self.weight, self.eps, residual)
        if self._cpu_ok(x) and (residual is None or residual.shape == x.shape):
            out, summed = self._cpu.rmsnorm(x, self.weight, self.eps, residual)
            return out, x if summed is None else summed
        if residual is not None:
            x = x + residual
        return self._norm(x), x
