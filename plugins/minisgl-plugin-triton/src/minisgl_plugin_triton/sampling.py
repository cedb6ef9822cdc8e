"""Temperature sampling over the logits (Gumbel-max), in Triton.

Sampling ``softmax(logits / T)`` the PyTorch way takes an upcast, a division,
a softmax, noise generation, another division and an argmax: six passes over a
``[batch, vocab]`` matrix (about 0.7 ms per decode step at batch 256 with a
152k vocabulary on an H200). ``argmax(logits / T + Gumbel noise)`` draws from
the same distribution and needs one read of the logits, with noise generated
by Philox from ``(seed, row, column)`` (one Philox call yields four 32-bit
integers, used for four columns). Rows with ``T == 0`` take the plain argmax
in a loop of their own, with no noise drawn.

The noise, in base 2 (scaling every score by ``log2(e)`` leaves the argmax
where it is): ``score = x * inv_t * log2(e) - log2(E)`` with ``E = -ln(1 - w)``
an exponential variate and ``w = r / 2**32`` uniform. The largest noise comes
from the smallest ``E``, that is from small ``w``, where ``w`` is finest, and
for ``w < 2**-7`` ``E`` comes from its series (``w + w**2/2 + w**3/3``), not
from ``log(1 - w)``, which would lose those digits. On a GPU both logarithms
are the hardware's approximate base-2 logarithm (``fast_log``): the exact one
costs some twenty instructions each and made the kernel bound by arithmetic
(88 instructions per logit on sm_90, against 42), not by reading the logits.
Its error (about 2**-22 absolute) moves the noise by less than 1e-4 in the
worst case (``w`` just above ``2**-7``), far below a bf16 logit's rounding.

The work is split in two launches so that a large vocabulary keeps the whole
GPU busy: each program of the first scans one chunk of one row and keeps its
best score and index; the second picks each row's winner among its chunks.
The drawn tokens do not depend on the chunking.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice
from triton.runtime.interpreter import InterpretedFunction

CHUNK = 8192  # vocabulary entries per program of the first pass
BLOCK = 1024
# One logit per thread in each quarter of a block (BLOCK // 4 threads): with fewer threads the loads take two
# logits per thread while the noise has one, and every quarter then went through shared memory and a barrier
# to meet (sm_90, Triton 3.6).
WARPS = BLOCK // 4 // 32


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:
        return libdevice.fast_log2f(x)  # lg2.approx: one instruction
    else:
        return tl.log2(x)


@triton.jit
def _noise(r, FAST: tl.constexpr):
    """``-log2(E)``, ``E ~ Exp(1)``, from 32 random bits ``r``."""
    w = r.to(tl.uint32, bitcast=True).to(tl.float32) * 2.3283064365386963e-10  # r / 2**32, in [0, 1]
    series = w * (1.0 + w * (0.5 + w * 0.3333333333333333))  # -ln(1 - w) for small w: error below w**4 / 4
    via_log = -0.6931471805599453 * _log2(tl.maximum(1.0 - w, 5.960464477539063e-08), FAST)
    e = tl.maximum(tl.where(w < 0.0078125, series, via_log), 2.3283064365386963e-10)  # w == 0: the finest E
    return -_log2(e, FAST)


@triton.jit
def _take(best, best_idx, score, idx):
    take = score > best  # strict: the first (lowest) index wins a tie within a lane; NaN is never taken
    return tl.where(take, score, best), tl.where(take, idx, best_idx)


@triton.jit
def _logits(logits_ptr, row, stride, idx, vocab):
    return tl.load(logits_ptr + row * stride + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)


@triton.jit
def _sampled(best, best_idx, logits_ptr, row, stride, idx, vocab, r, scale, FAST: tl.constexpr):
    # Past the vocabulary the load gives -inf, and -inf * scale (> 0) plus the noise (finite: E is clamped)
    # stays -inf, which is never taken.
    score = _logits(logits_ptr, row, stride, idx, vocab) * scale + _noise(r, FAST)
    return _take(best, best_idx, score, idx)


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
    FAST: tl.constexpr,  # the hardware's approximate logarithm (not in Triton's interpreter)
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    inv_t = tl.load(inv_temp_ptr + row)
    cols = tl.arange(0, Q)
    best = tl.full((Q,), float("-inf"), tl.float32)
    best_idx = chunk * CHUNK + cols  # a chunk of only -inf (or NaN) reports its first index
    if inv_t == 0.0:  # greedy: the argmax, no noise
        for start in range(0, CHUNK, BLOCK):
            base = chunk * CHUNK + start
            for quarter in tl.static_range(4):
                idx = base + quarter * Q + cols
                best, best_idx = _take(best, best_idx, _logits(logits_ptr, row, stride, idx, vocab), idx)
    else:
        scale = inv_t * 1.4426950408889634  # log2(e) / T
        row_offset = row * num_chunks * (CHUNK // 4)
        for start in range(0, CHUNK, BLOCK):
            base = chunk * CHUNK + start
            # One Philox call gives four 32-bit integers: one for each quarter of the block.
            r0, r1, r2, r3 = tl.randint4x(seed, (row_offset + base // 4 + cols).to(tl.int32))
            best, best_idx = _sampled(best, best_idx, logits_ptr, row, stride, base + cols, vocab, r0, scale, FAST)
            best, best_idx = _sampled(best, best_idx, logits_ptr, row, stride, base + Q + cols, vocab, r1, scale, FAST)
            best, best_idx = _sampled(
                best, best_idx, logits_ptr, row, stride, base + 2 * Q + cols, vocab, r2, scale, FAST
            )
            best, best_idx = _sampled(
                best, best_idx, logits_ptr, row, stride, base + 3 * Q + cols, vocab, r3, scale, FAST
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


def gumbel_sample(
    logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int, *, fast_log: bool | None = None
) -> torch.Tensor:
    """One token per row: a draw from ``softmax(logits * inv_temperature)``, or the argmax where it is 0.
    ``fast_log``: the noise's logarithms by the hardware's approximation (None: wherever Triton compiles for
    the GPU; False: the exact ones, as the interpreter runs it)."""
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
        # Triton's CPU interpreter (TRITON_INTERPRET=1 when the kernel was defined) has no libdevice.
        FAST=not isinstance(_gumbel_chunk_kernel, InterpretedFunction) if fast_log is None else fast_log,
        num_warps=WARPS,
    )
    _pick_kernel[(rows,)](best, best_idx, out, chunks, BLOCK_C=triton.next_power_of_2(chunks), num_warps=1)
    return out
