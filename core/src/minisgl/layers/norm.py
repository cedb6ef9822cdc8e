"""RMSNorm with an optional fused residual add, and the ``(offset + weight)`` variant (Gemma's ``1 + weight``)."""

from __future__ import annotations

import torch
from torch import nn

from ..kernel import KernelSet, select_kernels
from .linear import default_loader, set_loader


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension, through the kernel set's ``rmsnorm``.

    ``offset``: the checkpoint stores ``weight - offset`` (Gemma's norms compute ``x / rms(x) * (1 + w)``: pass
    ``offset=1.0``). The offset is added once, when the checkpoint tensor is loaded, so the parameter holds the
    multiplier itself and the forward pass is the same single kernel call as Llama's (in a 16-bit dtype the sum is
    rounded to that dtype once, at load). ``kernels``: the layer ops (default: the best for ``device``/``dtype``).
    """

    def __init__(
        self,
        size: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        kernels: KernelSet | None = None,
    ):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        set_loader(self.weight, default_loader if offset == 0.0 else self._load_with_offset)
        self.kernels = kernels or select_kernels(device, self.weight.dtype)

    def _load_with_offset(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        default_loader(param, loaded.float() + self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rmsnorm(x, self.weight, self.eps)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; with no residual yet, ``x`` starts it."""
        return self.kernels.add_rmsnorm(x, residual, self.weight, self.eps)
