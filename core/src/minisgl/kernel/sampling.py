"""Temperature sampling in one pass over the logits (Gumbel-max), in Triton.

Sampling ``softmax(logits / T)`` the PyTorch way takes an upcast, a division,
a softmax, noise generation, another division and an argmax: six passes over a
``[batch, vocab]`` matrix (about 0.7 ms per decode step at batch 256 with a
152k vocabulary on an H200). ``argmax(logits / T + Gumbel noise)`` draws from
the same distribution and needs one read of the logits: each program scans one
row in blocks, generating its noise with Philox from ``(seed, row, column)``.
Rows with ``T == 0`` take the plain argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr,
    inv_temp_ptr,
    out_ptr,
    vocab,
    stride,
    seed,
    NUM_BLOCKS: tl.constexpr,  # the vocabulary is fixed per model: one compilation
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    inv_t = tl.load(inv_temp_ptr + row)
    greedy = inv_t == 0.0
    cols = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32)
    for block in range(0, NUM_BLOCKS):
        idx = block * BLOCK + cols
        mask = idx < vocab
        x = tl.load(logits_ptr + row * stride + idx, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, (row * vocab + idx).to(tl.int32))
        u = tl.minimum(tl.maximum(u, 1e-10), 1.0 - 1e-7)
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(greedy, x, x * inv_t + gumbel)
        score = tl.where(mask, score, float("-inf"))
        take = score > best
        best = tl.where(take, score, best)
        best_idx = tl.where(take, idx, best_idx)
    top = tl.max(best, axis=0)
    # Lowest index among equal maxima, like torch.argmax.
    cand = tl.where(best == top, best_idx, 2147483647)
    tl.store(out_ptr + row, tl.min(cand, axis=0).to(tl.int64))


def gumbel_sample(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """One token per row: a draw from ``softmax(logits * inv_temperature)``, or the argmax where it is 0."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows,)](
            logits,
            inv_temperature,
            out,
            vocab,
            logits.stride(0),
            seed,
            NUM_BLOCKS=triton.cdiv(vocab, 2048),
            BLOCK=2048,
            num_warps=8,
        )
    return out
