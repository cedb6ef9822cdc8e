"""FP8 matmuls on CUDA. Each takes ``x`` ``[..., K]`` in the model's dtype, the float8 weight ``[N, K]`` and its
per-row scales (``[N]``, or ``[N, ceil(K / block_k)]`` for block scales), quantizes ``x`` dynamically and returns
``[..., N]`` in ``x``'s dtype:

- :func:`scaled_mm_linear`: per-token x per-channel scales through ``torch._scaled_mm`` (its row-wise scaled FP8
  GEMM; Hopper and Ada, K and N multiples of 16), optionally with fast accumulation;
- :func:`tensor_epilogue_linear`: the same scales, applied by a Triton kernel to the output of cuBLASLt's
  unit-scale FP8 GEMM (fast accumulation);
- :func:`w8a8_linear`: the same scales, one Triton FP8 GEMM that applies them in its epilogue;
- :func:`weight_only_linear`: the FP8 weight (per-row or block scales) widened in registers against activations
  kept in their 16-bit dtype (no activation quantization), one Triton kernel;
- :func:`block_linear`: per-(token, block_k columns) x per-(row, block_k columns) scales in a Triton kernel;
- :func:`dequant_linear`: the fallback that always applies: de-quantize the weight, then the ordinary matmul.

The per-token paths (the first three) also take a :class:`~minisgl.layers.QuantizedActivation`: ``x`` already
quantized by the op that produced it, :func:`add_rmsnorm_quant` or :func:`silu_mul_quant` (the RMSNorm or the
SiLU x up before the layer, with the quantization in the same kernel), and then skip their own quantization.

Which of them runs at which token count is measured per layer shape when a model loads
(:mod:`minisgl_plugin_fp8.tuning`). Triton is imported on first use only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from minisgl.layers import LinearInput, QuantizedActivation

from .reference import FP8, FP8_MAX, dequantize, quantize_token_groups, quantize_tokens


def fp8_gemm_capable(device: torch.device) -> bool:
    """Whether the GPU has FP8 tensor cores (compute capability 8.9 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports (asked once per process)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def scaled_mm_supports(in_features: int, out_features: int) -> bool:
    """cuBLASLt's FP8 GEMM needs both the reduction and the output dimension to be multiples of 16."""
    return in_features % 16 == 0 and out_features % 16 == 0


def scaled_mm_linear(
    x: LinearInput, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, fast_accum: bool = False
) -> torch.Tensor:
    """``x @ (weight * scale).T + bias`` with ``x`` quantized per token; ``scale``: ``[N]`` float32.
    ``fast_accum``: the tensor cores' own accumulator throughout (no periodic promotion to float32)."""
    q, s, dtype, lead = token_quantized(x)
    # weight is [N, K] row-major, so weight.t() is the column-major [K, N] operand the GEMM wants.
    y = torch._scaled_mm(
        q, weight.t(), scale_a=s, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16, use_fast_accum=fast_accum
    )
    y = y if dtype == torch.bfloat16 else y.to(dtype)
    if bias is not None:
        y = y + bias
    return y.view(*lead, weight.shape[0])


def tensor_epilogue_linear(
    x: LinearInput, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, one: torch.Tensor
) -> torch.Tensor:
    """:func:`scaled_mm_linear`'s result through cuBLASLt's plain FP8 GEMM: unit scalar scales (``one``, a float32
    1.0 on ``x``'s device) and fast accumulation into a bf16 output, which a Triton kernel then scales in place
    by the token and channel scales (and adds the bias to)."""
    q, s, dtype, lead = token_quantized(x)
    y = torch._scaled_mm(q, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
    m, n = y.shape
    if m:
        _kernels()["scale_rows_cols"][(triton_cdiv(m, 16), triton_cdiv(n, 256))](
            y, s, scale, bias if bias is not None else y, m, n, y.stride(0), HAS_BIAS=bias is not None,
            BLOCK_M=16, BLOCK_N=256, num_warps=4,
        )  # fmt: skip
    y = y if dtype == torch.bfloat16 else y.to(dtype)
    return y.view(*lead, n)


#: A Triton GEMM's tile: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages).
Tile = tuple[int, int, int, int, int]


def w8a8_tile(m: int, n: int) -> Tile:
    """:func:`w8a8_linear`'s tile for ``m`` tokens and ``n`` outputs (the load-time tuning may pick another):
    the smallest row tile that holds the tokens, and column tiles narrow enough to give a large GPU's SMs one
    program each at decode sizes."""
    if m <= 16:
        return (16, 64 if n >= 64 * 132 else 32, 256, 4, 4)
    if m <= 64:
        return (64, 64, 128, 4, 4)
    if m <= 256:
        return (64, 128, 128, 4, 4)
    return (128, 128, 128, 8, 4)


def w8a8_linear(
    x: LinearInput, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, tile: Tile | None = None
) -> torch.Tensor:
    """:func:`scaled_mm_linear`'s result from one Triton FP8 GEMM that applies the token and channel scales (and
    the bias) in its epilogue; ``tile`` overrides :func:`w8a8_tile`."""
    q, s, dtype, lead = token_quantized(x)
    (m, k), n = q.shape, weight.shape[0]
    y = torch.empty((m, n), dtype=dtype, device=q.device)
    if m:
        block_m, block_n, block_k, warps, stages = tile or w8a8_tile(m, n)
        _kernels()["w8a8_gemm"][(triton_cdiv(m, block_m), triton_cdiv(n, block_n))](
            q, s, weight, scale, y, bias if bias is not None else y, m, n, k, q.stride(0), weight.stride(0),
            y.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return y.view(*lead, n)


def weight_only_tile(m: int, n: int) -> Tile:
    """:func:`weight_only_linear`'s tile: the smallest row tile that holds the tokens, and column tiles narrow
    enough to give every SM of a large GPU about two programs (the weight is read once: parallelism over it is
    what sets the speed). BLOCK_K is 128 unless the weight has block scales (then it is their width)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 128 if n >= 128 * 264 else 64 if n >= 64 * 200 else 32
    return block_m, block_n, 128, 4, 4


def weight_only_linear(
    x: LinearInput,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_k: int | None,
    bias: torch.Tensor | None,
    tile: Tile | None = None,
) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` with ``x`` kept in its 16-bit dtype: one Triton kernel widens each FP8
    weight tile in registers and applies the per-row (``scale`` ``[N]``) or per-block (``[N, ceil(K /
    block_k)]``) scales. For decode sizes, where the matmul is bound by reading the weight."""
    xt = x.dequantize() if isinstance(x, QuantizedActivation) else x
    k = xt.shape[-1]
    x2 = xt.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=xt.dtype, device=xt.device)
    if m:
        block_m, block_n, tile_k, warps, stages = tile or weight_only_tile(m, n)
        blocks = scale.dim() == 2
        _kernels()["weight_only_gemm"][(triton_cdiv(m, block_m), triton_cdiv(n, block_n))](
            x2, weight, scale, y, bias if bias is not None else y, m, n, k, x2.stride(0), weight.stride(0),
            y.stride(0), scale.stride(0), HAS_BIAS=bias is not None, BLOCK_SCALES=blocks, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k if blocks and block_k is not None else tile_k, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
    return y.view(*xt.shape[:-1], n)


def dequant_linear(
    x: LinearInput, weight: torch.Tensor, scale: torch.Tensor, block_k: int | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """De-quantize the weight to ``x``'s dtype on every call (it stays FP8 in memory), then ``F.linear``."""
    x = x.dequantize() if isinstance(x, QuantizedActivation) else x
    return F.linear(x, dequantize(weight, scale, block_k, x.dtype), bias)


def token_quantized(x: LinearInput) -> tuple[torch.Tensor, torch.Tensor, torch.dtype, tuple[int, ...]]:
    """``(FP8 values [M, K], per-token scales [M, 1], activation dtype, leading shape of the output)`` of a
    matmul's input: quantized here, or as its producer already quantized it."""
    if isinstance(x, QuantizedActivation):
        if x.scales.shape[-1] != 1:
            raise ValueError(f"a per-token FP8 GEMM got {x.scales.shape[-1]} scales per token")
        return x.values, x.scales, x.dtype, (x.tokens,)
    q, s = quant_tokens(x.reshape(-1, x.shape[-1]))
    return q, s, x.dtype, tuple(x.shape[:-1])


def add_rmsnorm_quant(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[QuantizedActivation, torch.Tensor]:
    """``(quant_tokens(norm(x + residual)), x + residual)`` in one Triton kernel (``residual`` None: ``x``
    starts the residual and is returned as it): what minisgl-plugin-triton's ``add_rmsnorm`` writes, quantized
    per token as the per-token GEMMs quantize it."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    rows = x2.shape[0]
    q = torch.empty((rows, n), dtype=FP8, device=x.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if residual is None:
        res, res_out = x2, x2  # neither read nor written (HAS_RES off); res_out names the dtype
    else:
        res = residual.reshape(-1, n)
        res = res if res.stride(-1) == 1 else res.contiguous()
        res_out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block = 1 << (n - 1).bit_length()
        per = max(1, min(16, 2048 // block))  # the kernel set's rows per program, so its reduction is the same
        _kernels()["rmsnorm_quant"][(triton_cdiv(rows, per),)](
            x2, res, weight, q, s, res_out, rows, n, x2.stride(0), res.stride(0), q.stride(0), eps, FP8_MAX,
            HAS_RES=residual is not None, ROWS=per, BLOCK=block, num_warps=4 if block * per <= 4096 else 8,
        )  # fmt: skip
    out = QuantizedActivation(q, s, x.dtype)
    return out, (x if residual is None else res_out.view(x.shape))


#: :func:`silu_mul_quant` holds a whole row in one program: up to this many outputs per token.
SILU_QUANT_MAX = 32768


def silu_mul_quant(gate_up: torch.Tensor) -> QuantizedActivation:
    """``quant_tokens(silu(gate) * up)`` for ``gate_up`` ``[M, 2n]`` in one Triton kernel: what
    minisgl-plugin-triton's ``silu_mul`` writes, quantized per token (``n`` up to :data:`SILU_QUANT_MAX`)."""
    n = gate_up.shape[-1] // 2
    x2 = gate_up.reshape(-1, 2 * n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    rows = x2.shape[0]
    q = torch.empty((rows, n), dtype=FP8, device=gate_up.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=gate_up.device)
    if rows:
        block = 1 << (n - 1).bit_length()
        warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
        _kernels()["silu_mul_quant"][(rows,)](
            x2, q, s, n, x2.stride(0), q.stride(0), FP8_MAX, BLOCK=block, num_warps=warps
        )  # fmt: skip
    return QuantizedActivation(q, s, gate_up.dtype)


def quant_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 of ``x`` ``[M, K]``: one fused Triton kernel when Triton is there, else PyTorch ops."""
    if not triton_available() or not x.is_cuda:
        return quantize_tokens(x)
    return _triton_quant(x, None)


def quant_token_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-``group``-columns FP8 of ``x`` ``[M, K]`` (columns padded to whole groups)."""
    if not triton_available() or not x.is_cuda:
        return quantize_token_groups(x, group)
    return _triton_quant(x, group)


def _triton_quant(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = _kernels()["quant"]
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    width = k if group is None else group
    blocks = 1 if group is None else -(-k // group)
    q = torch.empty((m, width * blocks), dtype=FP8, device=x.device)
    s = torch.empty((m, blocks), dtype=torch.float32, device=x.device)
    if m:
        block = max(16, 1 << (width - 1).bit_length())
        warps = 8 if block >= 4096 else 4
        kernel[(m, blocks)](x, q, s, k, width, x.stride(0), q.stride(0), FP8_MAX, BLOCK=block, num_warps=warps)
    return q, s


def block_linear(
    x: LinearInput, weight: torch.Tensor, scale: torch.Tensor, block_k: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` with block scales: ``scale`` ``[N, ceil(K / block_k)]``, ``x``
    quantized per token and ``block_k`` columns; one Triton kernel accumulates each k block in float32 and
    applies both scales to it."""
    x = x.dequantize() if isinstance(x, QuantizedActivation) else x
    kernel = _kernels()["block_gemm"]
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0]
    q, s = quant_token_groups(x2, block_k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 1024 else 128
        block_n = 64 if m <= 64 else 128
        grid = (triton_cdiv(m, block_m), triton_cdiv(n, block_n))
        kernel[grid](
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
            s.stride(0),
            scale.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=4 if block_m * block_n <= 64 * 128 else 8,
            num_stages=3,
        )
    return y.view(*x.shape[:-1], n)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernels() -> dict[str, Any]:
    """The Triton kernels, imported (and compiled) on first use."""
    from . import triton_kernels

    return {
        name: getattr(triton_kernels, name)
        for name in (
            "quant",
            "block_gemm",
            "w8a8_gemm",
            "scale_rows_cols",
            "weight_only_gemm",
            "rmsnorm_quant",
            "silu_mul_quant",
        )  # fmt: skip
    }
