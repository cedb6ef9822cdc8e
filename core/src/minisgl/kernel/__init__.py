"""The kernels the layers call, chosen once per engine by :func:`select_kernels`.

:class:`KernelSet` is plain PyTorch (``kernels="torch"``, the reference). ``"auto"`` gives
:class:`TritonKernels` on CUDA when Triton is importable and :class:`NativeCPUKernels` (the C
kernels of :mod:`minisgl.kernel.cpu`) for float32 on CPU when they build. An op of a variant
takes the PyTorch path for inputs its kernel does not handle, so a layer's forward is one call.

Triton kernels mark arguments that change from call to call (row counts, seeds, pointers into
packed buffers) ``do_not_specialize``, so a running server never stops to compile a variant.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

QKNorm = tuple[torch.Tensor, torch.Tensor, float]  # (q weight, k weight, eps) of a per-head RMSNorm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, rounded to ``x``'s dtype before the weight (as Hugging Face models do)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one op, the same arithmetic
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def weight_major(rows: int) -> bool:
    """Whether CPU float32 :meth:`KernelSet.linear` computes ``(weight @ x.T).T``: faster on every
    shape measured at 2-8 and 16-256 rows, even at 10-15; one row is a matrix-vector product
    either way, and from a few hundred rows (prefill) ``F.linear`` is as fast or faster."""
    return 2 <= rows <= 256


class KernelSet:
    """The ops in plain PyTorch; subclasses replace them with kernels where those apply."""

    name = "torch"
    #: One-pass temperature sampling ``(logits, inv_temperature, seed) -> tokens``; None: not available.
    gumbel_sample: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None

    def __init__(self) -> None:
        # Every layer rotates by the same positions: rope factors are computed once per forward,
        # keyed on that positions tensor and its version (an in-place edit misses).
        self._rope_factors: tuple[Any, ...] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear``; on CPU float32 MKL's GEMM is slow for few rows of ``x`` (1.2-2.8x on AMD EPYC),
        so at 2-256 rows the weight is the left operand. Below 16 rows ``x`` and the result are made
        row-major (a column-major one slows this GEMM 2-3x and every row-wise op after it)."""
        if x.device.type != "cpu" or x.dtype != torch.float32:
            return F.linear(x, weight, bias)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not weight_major(rows):
            return F.linear(x, weight, bias)
        x2 = x.reshape(rows, x.shape[-1])
        if rows < 16:
            x2 = x2.contiguous()
        y = torch.mm(weight, x2.t()).t()
        if rows < 16:
            y = y.contiguous()
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], weight.shape[0])

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; with no residual yet, ``x`` starts it."""
        if residual is not None:
            x = x + residual
        return rms_norm(x, weight, eps), x

    def rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, qk_norm: QKNorm | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half rope of ``q`` ``[T, hq, d]`` and ``k`` ``[T, hkv, d]`` (each head RMS-normalised
        first with ``qk_norm``); ``cos_sin[pos]`` is ``d/2`` cosines then ``d/2`` sines."""
        if qk_norm is not None:
            q, k = rms_norm(q, qk_norm[0], qk_norm[2]), rms_norm(k, qk_norm[1], qk_norm[2])
        cached = self._rope_factors
        if cached is not None and cached[0] is positions and cached[1] == positions._version and cached[2] is cos_sin:
            cos2, sin2 = cached[3], cached[4]
        else:
            cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
            cos2, sin2 = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
            self._rope_factors = (positions, positions._version, cos_sin, cos2, sin2)
        return _rotate(q, cos2, sin2), _rotate(k, cos2, sin2)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        """``k_cache[loc] = k; v_cache[loc] = v``: rows ``[T, heads, d]``, caches ``[slots, heads, d]``."""
        k_cache.index_copy_(0, loc, k.to(k_cache.dtype))
        v_cache.index_copy_(0, loc, v.to(v_cache.dtype))

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)


def _rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]`` in three elementwise ops (``x.roll`` is ``[x2, x1]``)."""
    x32 = x.float()
    if x32.stride(-1) != 1:
        x32 = x32.contiguous()  # attention wants head_dim contiguous (SDPA on CPU is slow otherwise)
    return (x32 * cos2 + x32.roll(x.shape[-1] // 2, dims=-1) * sin2).to(x.dtype)


class TritonKernels(KernelSet):
    """CUDA: fused RMSNorm (+ residual), q/k-norm + rope, SiLU x up, KV store and sampling, each one launch."""

    name = "triton"

    def __init__(self) -> None:
        super().__init__()
        from .norm_rope import qk_norm_rope, rmsnorm, silu_and_mul
        from .sampling import gumbel_sample
        from .store import store_kv

        self._rmsnorm, self._rope, self._silu_mul, self._store = rmsnorm, qk_norm_rope, silu_and_mul, store_kv
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


def _f32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in tensors)


class NativeCPUKernels(KernelSet):
    """CPU float32: the C kernels of :mod:`minisgl.kernel.cpu` (few-row GEMM, RMSNorm, rope, SiLU x up,
    KV store, argmax); other inputs take the PyTorch path."""

    name = "native"

    def __init__(self, lib: Any):
        super().__init__()
        self.lib = lib  # a minisgl.kernel.cpu.CpuKernels

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


KERNEL_CHOICES = ("auto", "torch")


def select_kernels(
    device: torch.device | str | None = None, dtype: torch.dtype | None = None, choice: str = "auto"
) -> KernelSet:
    """The kernel set for layers on ``device`` computing in ``dtype`` (``EngineConfig.kernels``:
    ``"auto"`` the fastest the device has, ``"torch"`` plain PyTorch)."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernel set '{choice}'; expected one of {', '.join(KERNEL_CHOICES)}")
    kind = torch.device(device or "cpu").type
    if choice == "auto" and kind == "cuda" and importlib.util.find_spec("triton") is not None:
        return TritonKernels()
    if choice == "auto" and kind == "cpu" and (dtype or torch.get_default_dtype()) == torch.float32:
        from .cpu import load_cpu_kernels

        lib = load_cpu_kernels()
        if lib is not None:
            return NativeCPUKernels(lib)
    return KernelSet()
