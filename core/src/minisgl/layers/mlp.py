"""The gated MLP (SwiGLU and friends)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernel
from ..distributed import Communicator, TPInfo
from .linear import ColumnParallelLinear, RowParallelLinear

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(name: str):  # noqa: ANN201 - returns a tensor function
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation '{name}'; supported: {', '.join(ACTIVATIONS)}") from None


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one column-parallel weight."""

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
    ):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], tp=tp, dtype=dtype, device=device
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp, comm=comm, dtype=dtype, device=device)
        self.act = activation(act)
        self._fused = kernel.silu_mul_kernel() if act == "silu" and kernel.enabled(device) else None
        self._cpu = kernel.cpu_kernels(device, dtype) if act == "silu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:  # one Triton kernel on CUDA (see minisgl.kernel)
            return self.down_proj(self._fused(self.gate_up_proj(x)))
        gate_up = self.gate_up_proj(x)
        if self._cpu is not None and gate_up.dim() == 2 and gate_up.dtype == torch.float32:  # one C kernel
            return self.down_proj(self._cpu.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
