"""Temperature sampling over the logits (Gumbel-max), in Triton.

Sampling ``softmax(logits / T)`` the PyTorch way takes an upcast, a division,
a softmax, noise generation, another division and an argmax: six passes over a
``[batch, vocab]`` matrix (about 0.7 ms per decode step at batch 256 with a
152k vocabulary on an H200). ``argmax(logits / T + Gumbel noise)`` draws from
the same distribution and needs one read of the logits, with noise generated
by Philox from ``(seed, row, column)`` (one Philox call yields four uniforms,
used for four columns). Rows with ``T == 0`` take the plain
argmax.

The work is split in two launches so that a large vocabulary keeps the whole
GPU busy: each program of the first scans one chunk of one row and keeps its
best score and index; the second picks each row's winner among its chunks.
The drawn tokens do not depend on the chunking.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 8192  # vocabulary entries per program of the first pass
BLOCK = 1024


@triton.jit
def _consider(best, best_idx, logits_ptr, row, stride, idx, vocab, u, inv_t, greedy):
    mask = idx < vocab
    x = tl.load(logits_ptr + row * stride + idx, mask=mask, other=float("-inf")).to(tl.float32)
    u = tl.minimum(tl.maximum(u, 1e-10), 1.0 - 1e-7)
    score = tl.where(greedy, x, x * inv_t - tl.log(-tl.log(u)))
    score = tl.where(mask, score, float("-inf"))
    take = score > best  # strict: the first (lowest) index wins a tie within a lane
    return tl.where(take, score, best), tl.where(take, idx, best_idx)


@triton.jit(do_not_specialize=["seed"])
def _gumbel_chunk_kernel(
    logits_ptr,
    inv_temp_ptr,
    best_ptr,
    best_idx_ptr,
    vocab,
    stride,
    num_chunks,
    seed,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    Q: tl.constexpr,  # BLOCK // 4
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    inv_t = tl.load(inv_temp_ptr + row)
    greedy = inv_t == 0.0
    cols = tl.arange(0, Q)
    best = tl.full((Q,), float("-inf"), tl.float32)
    best_idx = chunk * CHUNK + cols  # a chunk of only -inf (or NaN) reports its first index
    row_offset = row * num_chunks * (CHUNK // 4)
    for start in range(0, CHUNK, BLOCK):
        base = chunk * CHUNK + start
        # One Philox call gives four uniforms: one for each quarter of the block.
        u0, u1, u2, u3 = tl.rand4x(seed, (row_offset + base // 4 + cols).to(tl.int32))
        best, best_idx = _consider(best, best_idx, logits_ptr, row, stride, base + cols, vocab, u0, inv_t, greedy)
        best, best_idx = _consider(best, best_idx, logits_ptr, row, stride, base + Q + cols, vocab, u1, inv_t, greedy)
        best, best_idx = _consider(
            best, best_idx, logits_ptr, row, stride, base + 2 * Q + cols, vocab, u2, inv_t, greedy
        )
        best, best_idx = _consider(
            best, best_idx, logits_ptr, row, stride, base + 3 * Q + cols, vocab, u3, inv_t, greedy
        )
    top = tl.max(best, axis=0)
    # Lowest index among equal maxima, like torch.argmax.
    cand = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)
    tl.store(best_ptr + row * num_chunks + chunk, top)
    tl.store(best_idx_ptr + row * num_chunks + chunk, cand)


@triton.jit
def _pick_kernel(best_ptr, best_idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < num_chunks
    score = tl.load(best_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    idx = tl.load(best_idx_ptr + row * num_chunks + c, mask=mask, other=2147483647)
    top = tl.max(score, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(score == top, idx, 2147483647), axis=0).to(tl.int64))


def gumbel_sample(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """One token per row: a draw from ``softmax(logits * inv_temperature)``, or the argmax where it is 0."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    best = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _gumbel_chunk_kernel[(rows, chunks)](
        logits,
        inv_temperature,
        best,
        best_idx,
        vocab,
        logits.stride(0),
        chunks,
        seed,
        CHUNK=CHUNK,
        BLOCK=BLOCK,
        Q=BLOCK // 4,
        num_warps=4,
    )
    _pick_kernel[(rows,)](best, best_idx, out, chunks, BLOCK_C=triton.next_power_of_2(chunks), num_warps=1)
    return out
