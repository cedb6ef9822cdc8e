"""The gated MLP (SwiGLU and friends)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import Communicator, TPInfo
from ..kernel import KernelSet, select_kernels
from .linear import ColumnParallelLinear, RowParallelLinear
from .quant import LinearInput, QuantMethod

#: The activations :class:`GatedMLP` accepts, by their transformers ``hidden_act`` names: ``silu`` (SwiGLU:
#: Llama, Mistral, Qwen; one fused kernel-set call), ``gelu`` (exact erf GELU) and ``gelu_pytorch_tanh`` (the
#: tanh approximation: Gemma's GeGLU).
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):  # noqa: ANN201 - returns a tensor function
    """The tensor function for activation ``name`` (a key of :data:`ACTIVATIONS`); a ``ValueError`` listing the
    supported names otherwise."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation '{name}'; supported: {', '.join(ACTIVATIONS)}") from None


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one column-parallel weight.

    ``act``: a name from :data:`ACTIVATIONS` (``silu``, ``gelu``, ``gelu_pytorch_tanh``), usually
    the config's ``hidden_act``; another name is a ``ValueError`` listing them. Checkpoints name the weights
    ``gate_proj``/``up_proj``/``down_proj`` (fused here through :data:`~minisgl.models.STACKED_PARAMS`).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str = "silu",
        *,
        tp: TPInfo,
        comm: Communicator,
        dtype: torch.dtype,
        device: torch.device,
        kernels: KernelSet | None = None,
        quant: QuantMethod | None = None,
    ):
        super().__init__()
        kernels = kernels or select_kernels(device, dtype)
        kw: dict[str, Any] = {"tp": tp, "dtype": dtype, "device": device, "kernels": kernels, "quant": quant}
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], **kw)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, comm=comm, **kw)
        self.act = activation(act)
        self.is_silu = act == "silu"
        self.act_mul = kernels.silu_mul if self.is_silu else self._act_mul

    def _act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    def forward(self, x: LinearInput) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = self.down_proj.fused_input if self.is_silu else None  # SiLU x up quantized for down_proj
        op = fused.silu_mul_op(gate_up.numel() // gate_up.shape[-1]) if fused is not None else None
        return self.down_proj(op(gate_up) if op is not None else self.act_mul(gate_up))
