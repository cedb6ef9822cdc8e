"""A candidate FP8 GEMM for decode sizes, measured by bench_gemm.py before it goes into the plugin: weight-only
FP8 (the weight read as float8 and widened in registers, the activations kept in bf16, no activation
quantization). Needs CUDA and Triton; imported by bench_gemm.py only.
"""

# ruff: noqa: N803  (Triton's constexpr arguments are upper case)

from __future__ import annotations

import torch
import triton
import triton.language as tl


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Weight-only FP8 (activations stay in their 16-bit dtype): C[m, n] = sum_k A[m, k] * B[n, k] * b_scale, the FP8
# weight tile widened in registers. At decode sizes the matmul is bound by reading the weight, so reading half the
# bytes and skipping the activation quantization is what pays. BLOCK_SCALES: b_scale[n, kb] per BLOCK_K columns
# (BLOCK_K is then the checkpoint's block width); else b_scale[n], applied once at the end.
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
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def weight_only_config(m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of :func:`weight_only_linear` for ``m`` tokens and ``n`` outputs:
    the smallest row tile that holds the tokens, and column tiles narrow enough to give every SM of a large GPU
    about two programs (the weight is read once, so parallelism over it is what sets the speed)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 128 if n >= 128 * 264 else 64 if n >= 64 * 200 else 32
    return block_m, block_n, 4, 4


def weight_only_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_k: int | None,
    bias: torch.Tensor | None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` with ``x`` kept in its 16-bit dtype: one Triton kernel widens each FP8
    weight tile in registers and applies the per-row (``scale`` ``[N]``) or per-block (``[N, ceil(K /
    block_k)]``) scales, so no activation is quantized. Meant for decode sizes (a few dozen tokens), where the
    matmul is bound by reading the weight; ``config`` overrides :func:`weight_only_config` (benchmarks)."""
    kernel = weight_only_gemm
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        block_m, block_n, warps, stages = config or weight_only_config(m, n)
        blocks = scale.dim() == 2
        block = block_k if blocks and block_k is not None else 128
        kernel[(cdiv(m, block_m), cdiv(n, block_n))](
            x2,
            weight,
            scale,
            y,
            bias if bias is not None else y,
            m,
            n,
            k,
            x2.stride(0),
            weight.stride(0),
            y.stride(0),
            scale.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_SCALES=blocks,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block,
            num_warps=warps,
            num_stages=stages,
        )
    return y.view(*x.shape[:-1], n)
