"""Writing new K and V rows into the paged pool in one launch.

PyTorch needs two ``index_copy_`` kernels per layer (K, V) plus a copy that
makes V contiguous (it is a strided slice of the fused q/k/v output). This
kernel reads both rows where they are and writes both slots: one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["loc_ptr"])
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_row_stride,
    v_row_stride,
    loc_ptr,
    k_cache_ptr,
    v_cache_ptr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    row = t.to(tl.int64)
    k = tl.load(k_ptr + row * k_row_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    v = tl.load(v_ptr + row * v_row_stride + offs, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """``k_cache[loc] = k; v_cache[loc] = v`` for ``[tokens, heads, head_dim]`` rows (any row stride).

    ``k_cache``/``v_cache`` are contiguous ``[slots, heads, head_dim]`` views of one layer.
    """
    tokens = loc.numel()
    if tokens == 0:
        return
    row = k_cache.shape[1] * k_cache.shape[2]
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride(-2) == k.shape[-1] and v.stride(-2) == v.shape[-1]
    _store_kv_kernel[(tokens,)](
        k, v, k.stride(0), v.stride(0), loc, k_cache, v_cache, ROW=row, BLOCK=triton.next_power_of_2(row)
    )
