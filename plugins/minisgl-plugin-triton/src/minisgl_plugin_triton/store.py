"""Writing new K and V rows into the paged pool in one launch.

PyTorch needs two ``index_copy_`` kernels per layer (K, V) plus a copy that
makes V contiguous (it is a strided slice of the fused q/k/v output). This
kernel reads both rows where they are and writes both slots: one launch.

Into a float8 (e4m3) cache the same launch also quantizes: each value times
the float32 reciprocal of its layer's scale, clamped to +-448 and rounded to
nearest even, the arithmetic of :func:`minisgl.kernel.quantize_kv` bit for bit,
which takes five launches (a clamp and a cast for each of K and V, then the
store).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernel import fp32_reciprocal

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@triton.jit(do_not_specialize=["loc_ptr", "k_inv", "v_inv"])
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_row_stride,
    v_row_stride,
    loc_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_inv,
    v_inv,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANT: tl.constexpr,
    LIMIT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    row = t.to(tl.int64)
    k = tl.load(k_ptr + row * k_row_stride + offs, mask=mask)
    v = tl.load(v_ptr + row * v_row_stride + offs, mask=mask)
    if QUANT:
        k = k.to(tl.float32) * k_inv
        k = tl.minimum(tl.maximum(k, -LIMIT), LIMIT).to(k_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        v = v.to(tl.float32) * v_inv
        v = tl.minimum(tl.maximum(v, -LIMIT), LIMIT).to(v_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def _check_rows(k: torch.Tensor, v: torch.Tensor) -> None:
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride(-2) == k.shape[-1] and v.stride(-2) == v.shape[-1]


def store_kv(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """``k_cache[loc] = k; v_cache[loc] = v`` for ``[tokens, heads, head_dim]`` rows (any row stride).

    ``k_cache``/``v_cache`` are contiguous ``[slots, heads, head_dim]`` views of one layer.
    """
    tokens = loc.numel()
    if tokens == 0:
        return
    row = k_cache.shape[1] * k_cache.shape[2]
    _check_rows(k, v)
    _store_kv_kernel[(tokens,)](
        k, v, k.stride(0), v.stride(0), loc, k_cache, v_cache, 1.0, 1.0,
        ROW=row, BLOCK=triton.next_power_of_2(row), QUANT=False, LIMIT=FP8_MAX,
    )  # fmt: skip


def store_kv_fp8(
    k: torch.Tensor,
    v: torch.Tensor,
    loc: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    """:func:`store_kv` into float8 e4m3 caches: ``k_cache[loc] = quantize_kv(k, k_scale)``, the same for ``v``."""
    tokens = loc.numel()
    if tokens == 0:
        return
    row = k_cache.shape[1] * k_cache.shape[2]
    _check_rows(k, v)
    _store_kv_kernel[(tokens,)](
        k, v, k.stride(0), v.stride(0), loc, k_cache, v_cache, fp32_reciprocal(k_scale), fp32_reciprocal(v_scale),
        ROW=row, BLOCK=triton.next_power_of_2(row), QUANT=True, LIMIT=FP8_MAX,
    )  # fmt: skip
