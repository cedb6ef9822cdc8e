"""Fused RMSNorm (with residual add) and rotary embedding in Triton.

In PyTorch each of these is a chain of small elementwise kernels (upcast,
square, mean, rsqrt, multiply, downcast, weight multiply; or split, four
multiplies, two adds, concatenate, downcast). At decode batch sizes every one
of them is launch- and latency-bound, so one pass per row does the same work
in a single kernel. Arithmetic matches the PyTorch layers: float32 inside,
rounded to the activation dtype where they round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_rows"])
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_rows,
    n_cols,
    inner,
    x_stride0,
    x_stride1,
    res_stride,
    eps,
    HAS_RES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Row r of the input is x[r // inner, r % inner, :]: a strided [tokens, heads, dim] view
    # (q or k sliced out of the fused qkv output) is read in place, without a copy.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x_off = ((rows // inner) * x_stride0 + (rows % inner) * x_stride1)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    out_off = rows[:, None] * n_cols + cols[None, :]
    if HAS_RES:
        r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(res_out_ptr.dtype.element_ty)  # the residual stream is kept in the activation dtype
        tl.store(res_out_ptr + out_off, summed, mask=mask)
        x = summed.to(tl.float32)
    var = tl.sum(x * x, axis=1) / n_cols
    y = (x * tl.rsqrt(var + eps)[:, None]).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + out_off, (y.to(tl.float32) * w).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):  # noqa: ANN201
    """``weight * norm(x)`` over the last dim; with ``residual``: ``(norm(x + residual), x + residual)``.

    ``x`` may be 2-D or a 3-D view with a unit last stride; outputs are contiguous.
    """
    shape = x.shape
    n = shape[-1]
    if x.dim() == 3 and x.stride(-1) == 1:
        inner, s0, s1 = shape[1], x.stride(0), x.stride(1)
    else:
        x = x.reshape(-1, n)
        if x.stride(-1) != 1:
            x = x.contiguous()
        inner, s0, s1 = 1, x.stride(0), 0
    rows = x.numel() // n
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    per = max(1, min(16, 2048 // block))
    grid = (triton.cdiv(rows, per),)
    warps = 4 if block * per <= 4096 else 8
    if residual is None:
        _rmsnorm_kernel[grid](
            x,
            x,
            weight,
            out,
            out,
            rows,
            n,
            inner,
            s0,
            s1,
            0,
            eps,
            HAS_RES=False,
            ROWS=per,
            BLOCK=block,
            num_warps=warps,
        )
        return out
    r2 = residual.reshape(-1, n)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    res_out = torch.empty(shape, dtype=x.dtype, device=x.device)
    _rmsnorm_kernel[grid](
        x,
        r2,
        weight,
        out,
        res_out,
        rows,
        n,
        inner,
        s0,
        s1,
        r2.stride(0),
        eps,
        HAS_RES=True,
        ROWS=per,
        BLOCK=block,
        num_warps=warps,
    )
    return out, res_out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, x_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)  # rounded like F.silu's output
    tl.store(out_ptr + row * n + cols, (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` for ``x`` of last dim ``2n``, in one pass."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](x2, out, n, x2.stride(0), BLOCK=block, num_warps=4)
    return out


@triton.jit
def _norm_rope_heads(
    src,
    stride_h,
    nheads,
    dst,
    w_ptr,
    cos,
    sin,
    d,
    dmask,
    eps,
    HAS_NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = (h < nheads) & dmask[None, :]
    ptr = src + h * stride_h + d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    ty = dst.dtype.element_ty
    if HAS_NORM:
        # Per-head RMSNorm rounded where the RMSNorm layer rounds: after the scaling, after the weight.
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * inv).to(ty).to(tl.float32) * w1).to(ty).to(tl.float32)
        x2 = ((x2 * inv).to(ty).to(tl.float32) * w2).to(ty).to(tl.float32)
    out = dst + h * (2 * HALF) + d[None, :]
    tl.store(out, (x1 * cos - x2 * sin).to(ty), mask=mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(ty), mask=mask)


@triton.jit(do_not_specialize=["pos_ptr"])
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    qw_ptr,
    kw_ptr,
    cs_ptr,
    pos_ptr,
    q_out,
    k_out,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    heads,
    kv_heads,
    eps,
    HAS_NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    cos = tl.load(cs_ptr + p * (2 * HALF) + d, mask=dmask, other=0.0)[None, :]
    sin = tl.load(cs_ptr + p * (2 * HALF) + HALF + d, mask=dmask, other=0.0)[None, :]
    _norm_rope_heads(
        q_ptr + t * q_stride_t, q_stride_h, heads, q_out + t * heads * (2 * HALF), qw_ptr,
        cos, sin, d, dmask, eps, HAS_NORM, HALF, BLOCK_H,
    )  # fmt: skip
    _norm_rope_heads(
        k_ptr + t * k_stride_t, k_stride_h, kv_heads, k_out + t * kv_heads * (2 * HALF), kw_ptr,
        cos, sin, d, dmask, eps, HAS_NORM, HALF, BLOCK_KH,
    )  # fmt: skip


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q`` ``[tokens, heads, head_dim]`` and ``k`` ``[tokens, kv_heads, head_dim]``
    in one launch, each head first RMS-normalised with ``q_weight``/``k_weight`` when they are given
    (Qwen3's q/k norm). Inputs may be strided views (slices of the fused qkv output); outputs are new
    contiguous tensors.
    """
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    q_out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, kv_heads, dim), dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    has_norm = q_weight is not None and k_weight is not None
    half = dim // 2
    _qk_norm_rope_kernel[(tokens,)](
        q,
        k,
        q_weight if has_norm else cos_sin,
        k_weight if has_norm else cos_sin,
        cos_sin,
        positions,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        heads,
        kv_heads,
        eps,
        HAS_NORM=has_norm,
        HALF=half,
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_KH=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q_out, k_out
