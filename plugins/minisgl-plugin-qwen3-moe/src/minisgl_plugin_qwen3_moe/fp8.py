"""FP8 expert weights in plain PyTorch, as minisgl-plugin-fp8 hands them to the ``fused`` backend: what the
kernel tests and the layer benchmark quantize their random experts with."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # float8_e4m3fn


def quantize_experts(w: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[E, R, K]`` weights as (float8_e4m3fn, float32 scales ``[E, R, k_blocks]``, the de-quantized weights in
    ``w``'s dtype): one scale per row and ``block`` input columns (the last block partial), or per row (None)."""
    e, r, k = w.shape
    width = block or k
    kb = -(-k // width)
    padded = torch.nn.functional.pad(w.float(), (0, kb * width - k)).view(e, r, kb, width)
    scale = padded.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(e, r, kb * width)[..., :k]
    dequantized = (q.float() * scale.repeat_interleave(width, dim=-1)[..., :k]).to(w.dtype)
    return q.contiguous(), scale, dequantized
