"""The ``fused`` MoE backend: Triton kernels for CUDA.

One MoE layer is three kernels after routing:

1. alignment: (token, expert) assignments sorted by expert and padded to
   blocks of ``block_m`` rows of one expert (:mod:`.align` holds the plain
   PyTorch version, used for large batches; a one-program Triton kernel is
   used for small ones, where launching a dozen small PyTorch ops would cost
   more than the expert matmuls);
2. a grouped GEMM over experts, ``x @ w13[e].T``, whose epilogue applies
   SiLU(gate) * up, writing one intermediate row per assignment;
3. a grouped GEMM ``h @ w2[e].T`` scaled by the routing weight, one output row
   per assignment, then summed over each token's ``top_k`` rows.

FP8 experts (``scales``: minisgl-plugin-fp8's checkpoints) are de-quantized
tile by tile in both GEMMs, each tile by its rows' scales of the input-column
block it lies in, so the layer streams half the bytes of bf16 experts.

Every block reads one expert's weight tile once for up to ``block_m`` tokens,
so at small batches the layer streams each active expert's weights once,
which is the memory-bandwidth floor. Nothing waits on the GPU (sizes are
upper bounds from shapes), so the layer can be captured in a CUDA graph.

This module imports Triton at import time; the plugin's entry module only
names it as a lazy factory, so CPU installs never import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.moe import BaseMoEBackend, ExpertScales

from .align import align_torch, max_blocks

# Assignments (tokens * top_k) up to which the one-program Triton alignment is used.
SMALL_ALIGN_MAX = 1024


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch parameters of one grouped GEMM."""

    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoEConfig:
    """``block_m`` (rows of one expert per block, shared by both GEMMs) and each GEMM's tiles."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig


def default_config(num_assignments: int, num_experts: int, dtype: torch.dtype) -> MoEConfig:
    """Tiles by the mean number of rows per expert: small blocks when weights dominate, large when FLOPs do."""
    per_expert = num_assignments / max(num_experts, 1)
    if dtype == torch.float32:  # twice the bytes per element: halve K tiles to keep shared memory in budget
        return MoEConfig(
            16 if per_expert <= 16 else 32, GemmConfig(32, 32, num_stages=2), GemmConfig(64, 32, num_stages=2)
        )
    if per_expert <= 16:
        return MoEConfig(16, GemmConfig(32, 128, 1, 4, 4), GemmConfig(64, 128, 1, 4, 4))
    if per_expert <= 48:
        return MoEConfig(32, GemmConfig(64, 128, 4, 4, 3), GemmConfig(64, 128, 4, 4, 3))
    if per_expert <= 160:
        return MoEConfig(64, GemmConfig(64, 64, 8, 4, 3), GemmConfig(128, 64, 8, 8, 3))
    return MoEConfig(128, GemmConfig(64, 64, 8, 8, 3), GemmConfig(128, 64, 8, 8, 3))


@triton.jit
def _tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Consecutive programs take GROUP_M row blocks of one column tile, so a weight tile
    # (one expert's, as row blocks of an expert are adjacent) is reused from L2.
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _align_kernel(
    ids_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_assign,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for start in range(0, num_assign, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_assign, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    cursor = ends - padded  # next free slot of each expert
    for start in range(0, num_assign, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_assign, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot  # same-expert assignments earlier in this chunk
        slot = tl.sum((cursor[None, :] + before) * onehot, axis=1)
        tl.store(sorted_ids_ptr + slot, offs, mask=offs < num_assign)
        cursor += tl.sum(onehot, axis=0)
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        # A block belongs to the expert whose padded run contains its first slot: count runs ending at or before it.
        expert = tl.sum(((blocks * BLOCK_M)[:, None] >= ends[None, :]).to(tl.int32), axis=1)
        expert = tl.where(expert < num_experts, expert, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_assign,
    top_k,
    N,
    K,
    num_blocks_m,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_hm,
    stride_hn,
    s_ptr,
    stride_se,
    stride_sn,
    stride_sk,
    scale_block,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    SCALED: tl.constexpr,
):
    """h[a, n] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, N + n]) for assignment a = t * top_k + j routed to e.
    SCALED: w13 is quantized (FP8); each tile is de-quantized by its rows' scales of the ``scale_block`` input
    columns it lies in (a multiple of BLOCK_K) before the product."""
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + offs_m)
    row_ok = assign < num_assign
    token = (assign // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :] * stride_xk
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + N * stride_wn
    sg_ptrs = s_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn
    su_ptrs = sg_ptrs + N * stride_sn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            bg = tl.load(g_ptrs, mask=col_ok[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if SCALED:
            kb = k0 // scale_block
            sg = tl.load(sg_ptrs + kb * stride_sk, mask=col_ok, other=0.0)
            su = tl.load(su_ptrs + kb * stride_sk, mask=col_ok, other=0.0)
            bg = (bg.to(tl.float32) * sg[None, :]).to(a.dtype)
            bu = (bu.to(tl.float32) * su[None, :]).to(a.dtype)
        if IEEE:  # float32 models: full-precision products, not TF32
            acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    h_ptrs = h_ptr + assign[:, None].to(tl.int64) * stride_hm + offs_n[None, :] * stride_hn
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_assign,
    N,
    K,
    num_blocks_m,
    stride_hm,
    stride_hk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    s_ptr,
    stride_se,
    stride_sn,
    stride_sk,
    scale_block,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    SCALED: tl.constexpr,
):
    """out[a, n] = weight[a] * (h[a] . w2[e, n]) for assignment a routed to expert e (SCALED: as above)."""
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + offs_m)
    row_ok = assign < num_assign
    rows = assign.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * stride_hm + offs_k[None, :] * stride_hk
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    s_ptrs = s_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if SCALED:
            sb = tl.load(s_ptrs + (k0 // scale_block) * stride_sk, mask=col_ok, other=0.0)
            b = (b.to(tl.float32) * sb[None, :]).to(a.dtype)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_hk
        b_ptrs += BLOCK_K * stride_wk
    weight = tl.load(topk_weights_ptr + rows, mask=row_ok, other=0.0)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, method: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_ids, block_expert)``: see :mod:`.align`. ``method``: "auto", "triton" or "torch"."""
    m = topk_ids.numel()
    if method == "torch" or (method == "auto" and m > SMALL_ALIGN_MAX):
        return align_torch(topk_ids, num_experts, block_m)
    nb = max_blocks(m, num_experts, block_m)
    ids = topk_ids.reshape(-1).contiguous()
    sorted_ids = torch.full((nb * block_m,), m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=ids.device)
    block_e = max(16, triton.next_power_of_2(num_experts))
    _align_kernel[(1,)](ids, sorted_ids, block_expert, m, num_experts, nb, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=64)
    return sorted_ids, block_expert


def _k_tile(tile: int, scale_block: int | None) -> int:
    """The K tile of a GEMM over weights with scales per ``scale_block`` input columns: a tile lies in one block."""
    if scale_block is None:
        return tile
    fit = scale_block & -scale_block  # the largest power of two dividing the block
    if fit < 16:
        raise ValueError(f"FP8 experts need a scale block width that is a multiple of 16, got {scale_block}")
    return min(tile, fit)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoEConfig | None = None,
    align_method: str = "auto",
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """The routed experts' output ``[tokens, hidden]``; see :meth:`minisgl.moe.BaseMoEBackend.forward`. With
    ``scales``, ``w13`` and ``w2`` are FP8 and are de-quantized tile by tile (weight-only FP8: the products run
    in the activations' dtype)."""
    tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if w13.shape[2] != hidden_size or tuple(w2.shape) != (num_experts, hidden_size, inter):
        raise ValueError(
            f"expert weights do not match: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}; "
            f"expected w13 [E, 2 * I, {hidden_size}] and w2 [E, {hidden_size}, I]"
        )
    top_k = topk_ids.shape[1]
    m = tokens * top_k
    if tokens == 0:
        return torch.zeros_like(hidden)
    cfg = config or default_config(m, num_experts, hidden.dtype)
    sorted_ids, block_expert = align(topk_ids, num_experts, cfg.block_m, align_method)
    nb = block_expert.numel()
    ieee = hidden.dtype == torch.float32
    block = scales.block_k if scales is not None else None
    g, d = cfg.gate_up, cfg.down
    gk, dk = _k_tile(g.block_k, block), _k_tile(d.block_k, block)
    # Without a block, one scale per row: every K tile reads column 0 (k0 // scale_block is 0 below K).
    s13, s2 = (scales.w13, scales.w2) if scales is not None else (None, None)
    g_scale = _scale_args(s13, block or triton.cdiv(hidden_size, gk) * gk, w13)
    d_scale = _scale_args(s2, block or triton.cdiv(inter, dk) * dk, w2)

    h = torch.empty(m, inter, dtype=hidden.dtype, device=hidden.device)
    _gate_up_silu_kernel[(nb * triton.cdiv(inter, g.block_n),)](
        hidden, w13, h, sorted_ids, block_expert,
        m, top_k, inter, hidden_size, nb,
        hidden.stride(0), hidden.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), h.stride(0), h.stride(1),
        *g_scale,
        BLOCK_M=cfg.block_m, BLOCK_N=g.block_n, BLOCK_K=gk, GROUP_M=g.group_m,
        EVEN_K=hidden_size % gk == 0, IEEE=ieee, SCALED=scales is not None,
        num_warps=g.num_warps, num_stages=g.num_stages,
    )  # fmt: skip
    out = torch.empty(m, hidden_size, dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(nb * triton.cdiv(hidden_size, d.block_n),)](
        h, w2, out, weights, sorted_ids, block_expert,
        m, hidden_size, inter, nb,
        h.stride(0), h.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0), out.stride(1),
        *d_scale,
        BLOCK_M=cfg.block_m, BLOCK_N=d.block_n, BLOCK_K=dk, GROUP_M=d.group_m,
        EVEN_K=inter % dk == 0, IEEE=ieee, SCALED=scales is not None,
        num_warps=d.num_warps, num_stages=d.num_stages,
    )  # fmt: skip
    if top_k == 1:
        return out
    return out.view(tokens, top_k, hidden_size).sum(dim=1)


def _scale_args(
    scale: torch.Tensor | None, block: int, unused: torch.Tensor
) -> tuple[torch.Tensor, int, int, int, int]:
    """A kernel's ``(s_ptr, stride_se, stride_sn, stride_sk, scale_block)``; without scales, ``unused`` (any
    tensor: the kernel never reads it) and zero strides."""
    if scale is None:
        return unused, 0, 0, 0, block
    return scale, scale.stride(0), scale.stride(1), scale.stride(2), block


class FusedMoEBackend(BaseMoEBackend):
    """Triton fused MoE (CUDA). ``config`` pins the tiles (benchmarks); by default they follow the batch size."""

    supports_cuda_graph = True

    def __init__(self, config: MoEConfig | None = None, align_method: str = "auto"):
        if align_method not in ("auto", "triton", "torch"):
            raise ValueError(f"align_method must be 'auto', 'triton' or 'torch', got {align_method!r}")
        self.config = config
        self.align_method = align_method
        # FP8 experts (minisgl-plugin-fp8), de-quantized tile by tile: Triton converts float8 e4m3 on compute
        # capability 8.9+ (Ada, Hopper); on older GPUs the method de-quantizes the experts at load instead.
        fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
        self.expert_dtypes = (torch.float8_e4m3fn,) if fp8 else ()

    def forward(
        self,
        hidden: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        scales: ExpertScales | None = None,
    ) -> torch.Tensor:
        return fused_moe(hidden, w13, w2, topk_weights, topk_ids, self.config, self.align_method, scales)
