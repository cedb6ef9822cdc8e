"""FP8 arithmetic in plain PyTorch: quantizing weights and activations, de-quantizing weights, and the
reference matmuls every GPU path is tested against. Scales multiply: ``real = fp8 * scale``."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_EPS = 1e-12  # keeps an all-zero row's scale finite


def expand_block_scale(scale: torch.Tensor, block: tuple[int, int], rows: int) -> torch.Tensor:
    """A checkpoint's block scales ``[ceil(rows / block[0]), k_blocks]`` as one row of scales per output row
    ``[rows, k_blocks]`` (float32): merged and tensor-parallel layers then slice scales as they slice rows."""
    if scale.dim() != 2 or scale.shape[0] != -(-rows // block[0]):
        raise ValueError(
            f"block scale has shape {tuple(scale.shape)}, expected [{-(-rows // block[0])}, k_blocks] for {rows} "
            f"rows in blocks of {block[0]}"
        )
    return scale.float().repeat_interleave(block[0], dim=0)[:rows].contiguous()


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block_k: int | None, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (float8 ``[out, in]``) times its scales: per row ``[out]``, or per row and ``block_k``
    columns ``[out, ceil(in / block_k)]``; the product is rounded once, to ``dtype``."""
    w = weight.float()
    if block_k is None:
        return (w * scale.float().reshape(-1, 1)).to(dtype)
    cols = scale.float().repeat_interleave(block_k, dim=1)[:, : w.shape[1]]
    return (w * cols).to(dtype)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-output-channel) FP8: ``(fp8 [out, in], scale float32 [out])``."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=_EPS)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 of ``x`` ``[M, K]``: ``(fp8 [M, K], scale float32 [M, 1])``."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_EPS)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_token_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 per token and ``group`` columns: ``(fp8 [M, k_blocks * group], scale float32 [M, k_blocks])``,
    the columns padded with zeros to whole groups."""
    m, k = x.shape
    blocks = -(-k // group)
    x32 = torch.nn.functional.pad(x.float(), (0, blocks * group - k)).view(m, blocks, group)
    scale = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_EPS)
    q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, blocks * group), scale.view(m, blocks)


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` in float32: what every path approximates."""
    y = x.float() @ dequantize(weight, scale, block_k, torch.float32).t()
    return y if bias is None else y + bias.float()


def reference_w8a8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """The same with ``x`` quantized as the GPU paths quantize it (per token, or per token and block),
    in float32: a GPU path differs from this by its accumulation order alone."""
    x2 = x.reshape(-1, x.shape[-1])
    if block_k is None:
        q, s = quantize_tokens(x2)
        xd = q.float() * s
    else:
        q, s = quantize_token_groups(x2, block_k)
        xd = (q.float().view(x2.shape[0], -1, block_k) * s[..., None]).view(x2.shape[0], -1)[:, : x2.shape[1]]
    y = xd @ dequantize(weight, scale, block_k, torch.float32).t()
    y = y if bias is None else y + bias.float()
    return y.view(*x.shape[:-1], weight.shape[0])
