"""The native kernel set: the C kernels of :mod:`minisgl_plugin_cpu.native` for float32 on CPU."""

from __future__ import annotations

import torch

from minisgl.kernel import KernelSet, QKNorm, rms_norm
from minisgl.plugins import Unsupported

from .native import CpuKernels, load_cpu_kernels


def _f32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in tensors)


class NativeCPUKernels(KernelSet):
    """CPU float32: the C kernels of :mod:`.native` (few-row GEMM, RMSNorm, rope, SiLU x up,
    KV store, argmax); other inputs take the PyTorch path."""

    name = "native"

    def __init__(self, lib: CpuKernels):
        super().__init__()
        self.lib = lib

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        # The C GEMM streams the weight at memory speed; MKL reaches about half of that at few rows.
        if 0 < rows <= self.lib.GEMM_MAX_ROWS and weight.stride(-1) == 1 and _f32(x, weight):
            x2 = x.reshape(rows, x.shape[-1])
            if x2.stride(1) != 1:
                x2 = x2.contiguous()
            return self.lib.linear(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])
        return super().linear(x, weight, bias)

    def _takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.dim() == 2 and _f32(x, weight) and 1 in x.stride()

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.lib.rmsnorm(x, weight, eps)[0] if self._takes(x, weight) else rms_norm(x, weight, eps)

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._takes(x, weight) and (residual is None or residual.shape == x.shape):
            out, summed = self.lib.rmsnorm(x, weight, eps, residual)
            return out, x if summed is None else summed
        return super().add_rmsnorm(x, residual, weight, eps)

    def rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, qk_norm: QKNorm | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The C kernel reads q and k as [T, heads, d] views of one matrix with one element stride.
        step = q.stride(2)
        one_stride = k.stride(2) == step and q.stride(1) == q.shape[2] * step and k.stride(1) == k.shape[2] * step
        if one_stride and _f32(q, k, *(qk_norm[:2] if qk_norm is not None else ())):
            return self.lib.rope(q, k, positions, cos_sin, qk_norm)
        return super().rope(positions, q, k, cos_sin, qk_norm)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2 and _f32(gate_up):
            return self.lib.silu_mul(gate_up)
        return super().silu_mul(gate_up)

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        if _f32(k, v, k_cache) and loc.dtype == torch.int64:
            width = k.shape[-2] * k.shape[-1]  # [T, width] views for the layouts the layers give
            self.lib.store_kv(k.reshape(-1, width), v.reshape(-1, width), loc.contiguous(), k_cache, v_cache)
        else:
            super().store_kv(k, v, loc, k_cache, v_cache)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and _f32(x) and 1 in x.stride():
            return self.lib.argmax(x)  # torch's runs at about 3 GB/s
        return x.argmax(dim=-1)


def native_kernels(device: torch.device, dtype: torch.dtype) -> NativeCPUKernels:
    """The factory of the kernel set ``native``: float32 only (``auto`` then takes the next set)."""
    if dtype != torch.float32:
        raise Unsupported(f"the C kernels compute float32, not {str(dtype).removeprefix('torch.')}")
    lib = load_cpu_kernels()
    if lib is None:
        raise Unsupported("the native CPU kernels could not be built (no working C compiler; set $CC)")
    return NativeCPUKernels(lib)
