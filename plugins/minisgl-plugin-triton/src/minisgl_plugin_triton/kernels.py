"""The Triton kernel set: each op one launch on CUDA, arithmetic as the PyTorch reference's.

Kernels mark arguments that change from call to call (row counts, seeds, pointers into packed
buffers) ``do_not_specialize``, so a running server never stops to compile a variant.
"""

from __future__ import annotations

import torch

from minisgl.kernel import KernelSet, QKNorm

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class TritonKernels(KernelSet):
    """CUDA: fused RMSNorm (+ residual), q/k-norm + rope, SiLU x up, KV store (quantizing into a float8 cache) and
    sampling, each one launch."""

    name = "triton"

    def __init__(self) -> None:
        super().__init__()
        from .norm_rope import qk_norm_rope, rmsnorm, silu_and_mul
        from .sampling import gumbel_sample
        from .store import store_kv, store_kv_fp8

        self._rmsnorm, self._rope, self._silu_mul, self._store = rmsnorm, qk_norm_rope, silu_and_mul, store_kv
        self._store_fp8 = store_kv_fp8
        self.gumbel_sample = gumbel_sample

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rmsnorm(x, weight, eps)

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._rmsnorm(x, weight, eps), x
        return self._rmsnorm(x, weight, eps, residual)

    def rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, qk_norm: QKNorm | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if qk_norm is None:
            return self._rope(q, k, cos_sin, positions)
        return self._rope(q, k, cos_sin, positions, *qk_norm)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_mul(gate_up)

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        if k.dtype == v.dtype == k_cache.dtype:
            self._store(k, v, loc, k_cache, v_cache)
        else:
            super().store_kv(k, v, loc, k_cache, v_cache)

    def store_kv_quantized(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        loc: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: float,
        v_scale: float,
    ) -> None:
        if k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn and k.dtype == v.dtype and k.dtype in _FLOATS:
            self._store_fp8(k, v, loc, k_cache, v_cache, k_scale, v_scale)
        else:
            super().store_kv_quantized(k, v, loc, k_cache, v_cache, k_scale, v_scale)


def triton_kernels(device: torch.device, dtype: torch.dtype) -> TritonKernels:
    """The factory of the kernel set ``triton`` (any dtype on CUDA)."""
    return TritonKernels()
