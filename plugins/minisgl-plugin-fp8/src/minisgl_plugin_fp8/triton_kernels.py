"""The Triton kernels of :mod:`minisgl_plugin_fp8.kernels` (this module imports Triton: import it lazily)."""

# ruff: noqa: N803  (Triton's constexpr arguments are upper case)

import triton
import triton.language as tl


# One program per (row, column group): scale = amax / fp8_max, q = x / scale (padding stays 0).
@triton.jit
def quant(x_ptr, q_ptr, s_ptr, K, WIDTH, stride_x, stride_q, fp8_max, BLOCK: tl.constexpr):
    row, grp = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    inside = cols < WIDTH
    k = grp * WIDTH + cols
    x = tl.load(x_ptr + row * stride_x + k, mask=inside & (k < K), other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / fp8_max, 1e-12)
    q = tl.clamp(x / scale, -fp8_max, fp8_max)
    tl.store(q_ptr + row * stride_q + grp * WIDTH + cols, q.to(q_ptr.dtype.element_ty), mask=inside)
    tl.store(s_ptr + row * tl.num_programs(1) + grp, scale)


# C[m, n] = sum over k blocks of (A_blk @ B_blk.T) * a_scale[m, kb] * b_scale[n, kb].
@triton.jit
def block_gemm(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_bsn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] view of B.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptr + offs_m * stride_asm + kb, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptr + offs_n * stride_bsn + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
