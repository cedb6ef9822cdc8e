"""Candidate per-token x per-channel FP8 GEMMs (W8A8), measured by bench_gemm.py before one goes into the plugin.
Needs CUDA and Triton; imported by bench_gemm.py only.

- :func:`w8a8_linear`: one Triton kernel on FP8 tensor cores: the whole K reduction accumulates in float32 and
  both scales (and the bias) are applied once, in the epilogue (unlike a block-scaled kernel, nothing is done to
  the accumulator inside the loop, so the tensor-core pipeline is never interrupted);
- :func:`tensor_epilogue_linear`: cuBLASLt's plain FP8 GEMM (``torch._scaled_mm`` with unit scalar scales and
  fast accumulation), then a Triton kernel that scales its output in place by the token and channel scales.
"""

# ruff: noqa: N803  (Triton's constexpr arguments are upper case)

from __future__ import annotations

import torch
import triton
import triton.language as tl
from minisgl_plugin_fp8 import kernels


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# C[m, n] = (sum_k A[m, k] B[n, k]) * a_scale[m] * b_scale[n] (+ bias[n]); A and B both FP8 and K-major, which is
# the operand layout of Hopper's FP8 tensor-core instructions (B is loaded [BLOCK_N, BLOCK_K] and transposed in
# registers, not read column by column).
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
    # Rows past M or N are read from row 0 (clamped, never stored): the loads need no row mask.
    rows_a = tl.where(m_ok, offs_m, 0)
    rows_b = tl.where(n_ok, offs_n, 0)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + rows_b[:, None] * stride_bn + offs_k[None, :]
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
    a_s = tl.load(as_ptr + offs_m, mask=m_ok, other=0.0)
    b_s = tl.load(bs_ptr + offs_n, mask=n_ok, other=0.0)
    acc = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


Config = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages


def w8a8_config(m: int, n: int) -> Config:
    """A tile for ``m`` tokens and ``n`` outputs: the smallest row tile that holds the tokens (up to 64, then 128)
    and column tiles narrow enough that a 132-SM GPU gets at least one program per SM at decode sizes."""
    if m <= 16:
        return (16, 64 if n >= 64 * 132 else 32, 256, 4, 4)
    if m <= 64:
        return (64, 64, 128, 4, 4)
    if m <= 256:
        return (64, 128, 128, 4, 4)
    return (128, 128, 128, 8, 4)


SWEEP: list[Config] = [
    (16, 32, 256, 4, 4),
    (16, 64, 256, 4, 4),
    (16, 64, 128, 4, 5),
    (32, 64, 128, 4, 4),
    (64, 64, 128, 4, 4),
    (64, 128, 128, 4, 4),
    (64, 128, 128, 8, 3),
    (128, 128, 128, 8, 4),
    (128, 256, 128, 8, 3),
    (64, 256, 128, 8, 4),
]


def w8a8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: Config | None = None,
) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` with ``x`` quantized per token (the plugin's fused Triton
    quantization), then :func:`w8a8_gemm`; ``config`` overrides :func:`w8a8_config` (benchmarks)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    q, s = kernels.quant_tokens(x2)
    m, n = x2.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        block_m, block_n, block_k, warps, stages = config or w8a8_config(m, n)
        w8a8_gemm[(cdiv(m, block_m), cdiv(n, block_n))](
            q,
            s,
            weight,
            scale,
            y,
            bias if bias is not None else y,
            m,
            n,
            k,
            q.stride(0),
            weight.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            EVEN_K=k % block_k == 0,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=warps,
            num_stages=stages,
        )
    return y.view(*x.shape[:-1], n)


# In place: C[m, n] = C[m, n] * a_scale[m] * b_scale[n] (+ bias[n]), one program per (row block, column block).
@triton.jit
def scale_rows_cols(c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, stride_cm, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    c = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    c = c * tl.load(as_ptr + offs_m, mask=m_ok, other=0.0)[:, None] * tl.load(bs_ptr + offs_n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        c += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(ptrs, c.to(c_ptr.dtype.element_ty), mask=ok)


_ONE: dict[torch.device, torch.Tensor] = {}


def tensor_epilogue_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """cuBLASLt's FP8 GEMM with unit scales and fast accumulation on ``x`` quantized per token, then its bf16
    output scaled in place by the token and channel scales."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    q, s = kernels.quant_tokens(x2)
    one = _ONE.setdefault(x.device, torch.ones((), device=x.device))
    y = torch._scaled_mm(q, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
    m, n = y.shape
    if m:
        scale_rows_cols[(cdiv(m, 16), cdiv(n, 256))](
            y, s, scale, bias if bias is not None else y, m, n, y.stride(0), HAS_BIAS=bias is not None,
            BLOCK_M=16, BLOCK_N=256,
        )  # fmt: skip
    y = y if x.dtype == torch.bfloat16 else y.to(x.dtype)
    return y.view(*x.shape[:-1], n)
