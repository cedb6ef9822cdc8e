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


# The GEMMs' epilogue: C[offs_m, offs_n] = acc (+ bias[offs_n]), rounded to C's dtype, inside M and N.
@triton.jit
def _store_tile(acc, c_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_cm, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


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
    _store_tile(acc, c_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_cm, HAS_BIAS)


# C[m, n] = (sum_k A[m, k] B[n, k]) * a_scale[m] * b_scale[n] (+ bias[n]): per-token x per-channel FP8 (W8A8). The
# whole reduction accumulates in float32 and the scales are applied once, in the epilogue, so the tensor-core
# pipeline runs uninterrupted. A and B are both K-major (B is loaded [BLOCK_N, BLOCK_K] and transposed in
# registers), the operand layout of Hopper's FP8 tensor-core instructions.
@triton.jit
def w8a8_gemm(
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
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    # Rows past M or N read row 0 (never stored), so the loads need no row mask.
    a_ptrs = a_ptr + tl.where(m_ok, offs_m, 0)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + tl.where(n_ok, offs_n, 0)[:, None] * stride_bn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc = acc * tl.load(as_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    acc = acc * tl.load(bs_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    _store_tile(acc, c_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_cm, HAS_BIAS)


# In place: C[m, n] = C[m, n] * a_scale[m] * b_scale[n] (+ bias[n]); the epilogue of a unit-scale FP8 GEMM.
@triton.jit
def scale_rows_cols(
    c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, stride_cm, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    c = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    c = c * tl.load(as_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    c = c * tl.load(bs_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    _store_tile(c, c_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_cm, HAS_BIAS)


# Weight-only FP8: C[m, n] = sum_k A[m, k] B[n, k] * b_scale, A in its 16-bit dtype and each FP8 weight tile
# widened in registers (no activation quantization; at a few tokens the matmul is bound by reading the weight).
# BLOCK_SCALES: b_scale[n, kb] per BLOCK_K columns (BLOCK_K is then the block width); else b_scale[n], applied at
# the end.
@triton.jit
def weight_only_gemm(
    a_ptr,
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
    stride_bsn,
    HAS_BIAS: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
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
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0).to(a.dtype)
        if BLOCK_SCALES:
            b_s = tl.load(bs_ptr + offs_n * stride_bsn + kb, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * b_s[None, :]
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCK_SCALES:
        acc *= tl.load(bs_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    _store_tile(acc, c_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_cm, HAS_BIAS)


# The producers of a quantized layer's input, each fused with the per-token quantization that layer's GEMM would
# run (`quant` above) on what the kernel set's op writes. Each reproduces that op's arithmetic and rounding
# (minisgl-plugin-triton's RMSNorm and SiLU x up: float32 inside, rounded to the activation dtype where they
# round), so the FP8 values and scales equal the unfused pair's.


# RMSNorm (after adding the residual, which is written back in the activation dtype) of ROWS rows per program,
# then per-row scale = amax / fp8_max and q = y / scale. `res_out_ptr` also names the activation dtype.
@triton.jit(do_not_specialize=["n_rows"])
def rmsnorm_quant(
    x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, n_rows, n_cols, x_stride, res_stride, q_stride, eps, fp8_max,
    HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * n_cols + cols[None, :], summed, mask=mask)
        x = summed.to(tl.float32)
    var = tl.sum(x * x, axis=1) / n_cols
    y = (x * tl.rsqrt(var + eps)[:, None]).to(res_out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    y = (y.to(tl.float32) * w).to(res_out_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=1) / fp8_max, 1e-12)
    q = tl.clamp(y / scale[:, None], -fp8_max, fp8_max)
    tl.store(q_ptr + rows[:, None] * q_stride + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, scale, mask=row_ok)


# silu(gate) * up of one row (gate: the first n columns of x, up: the next n), rounded as the kernel set rounds,
# then quantized per row. The whole row is one block: its amax comes before any FP8 value can be written.
@triton.jit
def silu_mul_quant(x_ptr, q_ptr, s_ptr, n, x_stride, q_stride, fp8_max, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / fp8_max, 1e-12)
    q = tl.clamp(y / scale, -fp8_max, fp8_max)
    tl.store(q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)
