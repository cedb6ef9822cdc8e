"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from ..kernel import KernelSet, select_kernels
from .linear import default_loader, set_loader


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6, *, dtype=None, device=None, kernels: KernelSet | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        set_loader(self.weight, default_loader)
        self.kernels = kernels or select_kernels(device, self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rmsnorm(x, self.weight, self.eps)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; with no residual yet, ``x`` starts it."""
        return self.kernels.add_rmsnorm(x, residual, self.weight, self.eps)
