"""RMSNorm with an optional fused residual add, and the ``(offset + weight)`` variant (Gemma's ``1 + weight``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..kernel import KernelSet, select_kernels
from .linear import LinearBase, default_loader, set_loader
from .quant import FusedInput


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
        self._fused: Callable[[], FusedInput | None] = _no_fusion

    def feeds(self, layer: LinearBase) -> None:
        """Declare that this norm's output (with a residual: :meth:`forward_with_residual`'s first result) is
        the input of ``layer`` and of nothing else, so the layer's quantization method may quantize it here, in
        the norm's kernel (:meth:`~minisgl.layers.QuantMethod.fused_input`). The layer's current method is asked
        at each call, so a method given to the layer later is followed."""
        self._fused = lambda: layer.fused_input

    def _load_with_offset(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        default_loader(param, loaded.float() + self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rmsnorm(x, self.weight, self.eps)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[Any, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; with no residual yet, ``x`` starts it. Where the layer this
        norm :meth:`feeds` takes it, the first result is that layer's :class:`~minisgl.layers.QuantizedActivation`
        instead (the same values, quantized in this kernel)."""
        fused = self._fused()
        op = fused.rmsnorm_op(x.numel() // x.shape[-1]) if fused is not None else None
        if op is not None:
            return op(x, residual, self.weight, self.eps)
        return self.kernels.add_rmsnorm(x, residual, self.weight, self.eps)


def _no_fusion() -> FusedInput | None:
    return None
