"""Paged attention through FlashAttention: prefill (new tokens over the cache) and decode.

The KV pool keeps one ``[num_pages, page_size, kv_heads, head_dim]`` buffer per
layer for K and one for V: FlashAttention's paged layout, read in place. minisgl's
page table holds one token slot per position of each request row; FlashAttention
wants one page per ``page_size`` positions. Slot ``s`` is on page ``s // page_size``,
so a request's page list is the slots at positions ``0, page_size, 2 * page_size, ...``
divided by the page size, gathered on the device from the request rows.

Metadata is built once per batch (one pinned host-to-device copy of the rows,
lengths and query offsets, one gather) and bound into a call that every layer
runs. Decode under CUDA graphs reads static buffers (a page table as wide as the
longest sequence, and the per-request lengths) that each replay refreshes in place;
padding requests attend to one token of the scratch page 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from minisgl.attention import AttentionContext, BaseAttnBackend
from minisgl.core import Batch
from minisgl.plugins import Unsupported

from .kernels import KERNELS, FlashAttnKernels
from .support import choose_generation, installed_generations

# (q [tokens, heads, head_dim], k_cache, v_cache) -> output like q
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]

# Why the spec declares no quantized KV dtype: FlashAttention 3 reads an FP8 cache only with an FP8 query (its
# descale factors cover q, k and v together), FlashAttention 2 and 4 not at all.
FP8_KV_REFUSAL = (
    "fa attention backend: FlashAttention reads an FP8 KV cache only with an FP8 query (FlashAttention 3; "
    "not 2 or 4), which this backend does not quantize; use --attn flashinfer for --kv-cache-dtype fp8_e4m3"
)


@dataclass
class FlashAttnMetadata:
    """What every layer of one batch reads: FlashAttention's page table, the attended lengths,
    and the kernel call with both (and, for prefill, the query offsets) bound."""

    page_table: Tensor  # [batch, pages] int32
    seqused_k: Tensor  # [batch] int32
    attend: Attend


def flash_page_table(token_table: Tensor, rows: Tensor, page_columns: Tensor, page_size: int) -> Tensor:
    """FlashAttention's ``[len(rows), len(page_columns)]`` int32 page table from minisgl's token-slot table.

    ``page_columns`` holds the position of each page's first token (``arange(pages) * page_size``).
    """
    slots = token_table[rows.view(-1, 1), page_columns.view(1, -1)]
    return slots if page_size == 1 else torch.div(slots, page_size, rounding_mode="floor")


def build_kernels(ctx: AttentionContext, generation: int | None = None) -> FlashAttnKernels:
    """The adapter of the best installed generation for this GPU and page size (or of ``generation``)."""
    if ctx.device.type != "cuda":
        raise ValueError(f"the fa attention backend needs a CUDA device, got '{ctx.device}'; use --attn torch")
    capability = torch.cuda.get_device_capability(ctx.device)
    try:
        chosen = choose_generation(capability, installed_generations(), generation, ctx.page_size)
    except Unsupported as exc:
        raise ValueError(f"fa attention backend: {exc}") from None
    return KERNELS[chosen]()


class FlashAttnBackend(BaseAttnBackend):
    """FlashAttention prefill and decode over the paged KV pool; decode can be captured in CUDA graphs.

    ``generation`` pins FlashAttention 2, 3 or 4 (default: the best installed one
    for this GPU); ``kernels`` supplies an adapter directly (tests).
    """

    supports_cuda_graph = True

    def __init__(
        self, ctx: AttentionContext, *, generation: int | None = None, kernels: FlashAttnKernels | None = None
    ):
        if ctx.kv_pool.layout.quantized:
            raise ValueError(FP8_KV_REFUSAL)
        if kernels is None:
            kernels = build_kernels(ctx, generation)
        problem = kernels.problem(ctx.head_dim, ctx.dtype, ctx.page_size)
        if problem is not None:
            raise ValueError(f"fa attention backend: {problem}")
        self.ctx = ctx
        self.kernels = kernels
        self.page_size = ctx.page_size
        self._pin = ctx.device.type == "cuda"
        max_pages = -(-ctx.max_seq_len // ctx.page_size)
        self._page_columns = torch.arange(max_pages, dtype=torch.int64, device=ctx.device) * ctx.page_size
        self._graph_table: Tensor | None = None
        self._graph_seqused: Tensor | None = None

    # ------------------------------------------------------------ metadata
    def _upload(self, values: list[int]) -> Tensor:
        host = torch.tensor(values, dtype=torch.int32, pin_memory=self._pin)
        return host.to(self.ctx.device, non_blocking=True)

    def _bind_decode(self, page_table: Tensor, seqused_k: Tensor) -> FlashAttnMetadata:
        attend = partial(self.kernels.decode, page_table=page_table, seqused_k=seqused_k, scale=self.ctx.scale)
        return FlashAttnMetadata(page_table, seqused_k, attend)

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.reqs
        n = len(reqs)
        lens = [r.device_len for r in reqs]
        values = [r.table_idx for r in reqs] + lens
        if batch.is_prefill:
            values += list(itertools.accumulate((r.extend_len for r in reqs), initial=0))
        dev = self._upload(values)
        pages = -(-max(lens) // self.page_size)
        table = flash_page_table(self.ctx.page_table, dev[:n].long(), self._page_columns[:pages], self.page_size)
        seqused_k = dev[n : 2 * n]
        if batch.is_decode:
            batch.attn_metadata = self._bind_decode(table, seqused_k)
            return
        attend = partial(
            self.kernels.prefill,
            page_table=table,
            seqused_k=seqused_k,
            cu_seqlens_q=dev[2 * n :],
            max_seqlen_q=max(r.extend_len for r in reqs),
            scale=self.ctx.scale,
        )
        batch.attn_metadata = FlashAttnMetadata(table, seqused_k, attend)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, layer_id: int, batch: Batch) -> Tensor:
        c, meta = self.ctx, batch.attn_metadata
        assert isinstance(meta, FlashAttnMetadata) and batch.out_loc is not None
        hq, hkv, d = c.num_qo_heads, c.num_kv_heads, c.head_dim
        pool = c.kv_pool
        pool.store_kv(k.view(-1, hkv, d), v.view(-1, hkv, d), batch.out_loc, layer_id)
        out = meta.attend(q.view(-1, hq, d), pool.k_cache(layer_id), pool.v_cache(layer_id))
        return out.reshape(-1, hq * d)

    # ---------------------------------------------------------- CUDA graphs
    def init_capture_graph(self, max_seq_len: int, batch_sizes: list[int]) -> None:
        max_bs = max(batch_sizes)
        pages = -(-max_seq_len // self.page_size)
        # Shared by every captured batch size: one graph replays at a time.
        self._graph_table = torch.zeros(max_bs, pages, dtype=torch.int32, device=self.ctx.device)
        self._graph_seqused = torch.ones(max_bs, dtype=torch.int32, device=self.ctx.device)

    def _graph_buffers(self) -> tuple[Tensor, Tensor]:
        if self._graph_table is None or self._graph_seqused is None:
            raise RuntimeError("init_capture_graph must run before a decode graph is captured or replayed")
        return self._graph_table, self._graph_seqused

    def prepare_for_capture(self, batch: Batch) -> None:
        table, seqused = self._graph_buffers()
        bs = batch.padded_size
        batch.attn_metadata = self._bind_decode(table[:bs], seqused[:bs])

    def prepare_for_replay(self, batch: Batch) -> None:
        table, seqused = self._graph_buffers()
        n, bs = batch.size, batch.padded_size
        self.prepare_metadata(batch)  # this batch's own (narrower) page table and lengths
        meta = batch.attn_metadata
        assert isinstance(meta, FlashAttnMetadata)
        width = meta.page_table.shape[1]
        table[:n, :width].copy_(meta.page_table)
        seqused[:n].copy_(meta.seqused_k)
        if bs > n:  # padding requests: one token on the scratch page 0
            table[n:bs, 0].zero_()
            seqused[n:bs].fill_(1)
        batch.attn_metadata = self._bind_decode(table[:bs], seqused[:bs])


def fa2_backend(ctx: AttentionContext) -> FlashAttnBackend:
    """Factory of ``fa2``: FlashAttention 2 only."""
    return FlashAttnBackend(ctx, generation=2)


def fa3_backend(ctx: AttentionContext) -> FlashAttnBackend:
    """Factory of ``fa3``: FlashAttention 3 only."""
    return FlashAttnBackend(ctx, generation=3)


def fa4_backend(ctx: AttentionContext) -> FlashAttnBackend:
    """Factory of ``fa4``: FlashAttention 4 only."""
    return FlashAttnBackend(ctx, generation=4)
