"""Paged attention through TensorRT-LLM's kernels, as FlashInfer 0.5.3 exposes them.

The kernels read the pool in place: each layer's K and V are
``[num_pages, page_size, kv_heads, head_dim]``, their ``NHD`` layout. Instead of
FlashInfer's ragged page lists they take a *block table*: ``[batch, width]`` int32
page indices, one row per request, plus each request's KV length. minisgl's page
table holds token slots per request row, and a page always belongs to one request
whole, so page ``j`` of a request is its slot at position ``j * page_size`` divided
by the page size. The table is gathered on the device; columns past a request's
last page hold 0, the scratch page, so a kernel that reads a whole tile of page
indices never sees a stale one.

Per batch, :meth:`TrtllmAttnBackend.prepare_metadata` binds one kernel call to the
batch's block table and lengths; every layer then makes that call. For decode
under CUDA graphs the block table and lengths live in static buffers as wide as
the longest sequence, refreshed in place before each replay.

Which kernel runs where (see :mod:`minisgl_plugin_trtllm.support`): the
``trtllm-gen`` context and decode kernels need compute capability 10.0/10.3; the
XQA decode kernel runs on 9.x, 10.x and 12.x. A backend without a context kernel
(``trtllm-xqa``) sends prefill batches to the core's ``torch`` reference; in
``--attn flashinfer,trtllm-xqa`` it never sees one.

``trtllm-xqa`` also reads an FP8 KV cache (``--kv-cache-dtype fp8_e4m3``; on Hopper
FlashInfer then runs XQA's FP8 kernel, which computes both products in FP8). The
pool stores ``k / k_scale`` and ``v / v_scale`` per layer; XQA takes the scores'
scale (``bmm1_scale``) and the output's (``bmm2_scale``), so each layer passes
``softmax_scale * k_scale`` and ``v_scale``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from minisgl.attention import AttentionContext, BaseAttnBackend, TorchAttnBackend
from minisgl.core import Batch

from .support import trtllm_gen_problem, xqa_problem

logger = logging.getLogger(__name__)

DecodeKernel = Literal["trtllm-gen", "xqa"]
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
FP8_KV_DTYPE = torch.float8_e4m3fn  # the quantized KV dtype XQA reads
SUPPORTED_HEAD_DIMS = (64, 128, 256)
XQA_PAGE_SIZES = (16, 32, 64, 128)  # flashinfer/jit/xqa.py: TOKENS_PER_PAGE
TRTLLM_GEN_PAGE_SIZES = (16, 32, 64)  # the page sizes FlashInfer's trtllm-gen tests cover
MAX_XQA_GROUP = 16  # query heads per KV head: the largest FlashInfer 0.5.3's XQA tests cover
# The kernels keep their semaphores/counters in the first 8 MiB (zeroed once, reset by the
# kernels themselves) and split-KV partial results after them.
WORKSPACE_BYTES = 128 << 20


@dataclass(frozen=True)
class TrtllmKernels:
    """The FlashInfer entry points a backend calls (replaceable in tests).

    ``decode`` has the signature of ``flashinfer.decode.trtllm_batch_decode_with_kv_cache``;
    ``context`` that of ``flashinfer.prefill.trtllm_batch_context_with_kv_cache``, or is
    ``None`` when prefill batches go to the torch reference.
    """

    decode: Callable[..., torch.Tensor]
    context: Callable[..., torch.Tensor] | None = None


def flashinfer_kernels(with_context: bool) -> TrtllmKernels:
    """FlashInfer's TensorRT-LLM entry points (imports FlashInfer)."""
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    if not with_context:
        return TrtllmKernels(trtllm_batch_decode_with_kv_cache)
    from flashinfer.prefill import trtllm_batch_context_with_kv_cache

    return TrtllmKernels(trtllm_batch_decode_with_kv_cache, trtllm_batch_context_with_kv_cache)


@dataclass
class TrtllmMetadata:
    """One batch's kernel call, its batch arguments bound: ``run(query=q, kv_cache=(k, v))``."""

    run: Callable[..., torch.Tensor]
    block_tables: torch.Tensor  # [batch, width] int32 page indices
    seq_lens: torch.Tensor  # [batch] int32 KV length of each request, new tokens included


class TrtllmAttnBackend(BaseAttnBackend):
    """TensorRT-LLM paged attention over the KV pool; decode can be captured in CUDA graphs.

    ``decode`` picks the decode kernel family (``"trtllm-gen"`` or ``"xqa"``);
    prefill runs ``kernels.context`` when there is one, else the torch reference.
    ``enable_pdl`` is passed to the kernels (``None``: FlashInfer's default, on from
    compute capability 9.0). Build it through :func:`build_trtllm_gen` or
    :func:`build_xqa`, which check the device and the model's shape first.
    """

    supports_cuda_graph = True

    def __init__(
        self,
        ctx: AttentionContext,
        kernels: TrtllmKernels,
        *,
        decode: DecodeKernel,
        enable_pdl: bool | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
    ):
        self.ctx = ctx
        self.kernels = kernels
        self.decode_kernel = decode
        self.enable_pdl = enable_pdl
        self.page_size = ctx.page_size
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=ctx.device)
        self.prefill_fallback = None
        if kernels.context is None:
            self.prefill_fallback = TorchAttnBackend(ctx)
        self._fallback_used = False
        self._columns = torch.arange(-(-ctx.max_seq_len // ctx.page_size), dtype=torch.int32, device=ctx.device)
        self._graph_tables: torch.Tensor | None = None
        self._graph_lens: torch.Tensor | None = None
        self._graph_metadata: dict[int, TrtllmMetadata] = {}
        # Per layer: the kernel's two scales (the KV cache's scales folded in; none for an unquantized cache,
        # whose scales are the ones bound per batch).
        layout = ctx.kv_pool.layout
        self._layer_scales: list[dict[str, float]] = []
        if layout.quantized:
            scales = [layout.kv_scales(i) for i in range(layout.num_layers)]
            self._layer_scales = [{"bmm1_scale": ctx.scale * k, "bmm2_scale": v} for k, v in scales]

    # ------------------------------------------------------------ block tables
    def _to_device(self, values: list[int]) -> torch.Tensor:
        """int32 values to the device in one (pinned, non-blocking) copy."""
        host = torch.tensor(values, dtype=torch.int32, pin_memory=self.ctx.device.type == "cuda")
        return host.to(self.ctx.device, non_blocking=True)

    def block_tables(self, rows: torch.Tensor, seq_lens: torch.Tensor, width: int) -> torch.Tensor:
        """``[len(rows), width]`` int32 page indices of the requests in page-table ``rows``
        (device tensors); columns at or past ``ceil(seq_len / page_size)`` hold page 0."""
        ps = self.page_size
        cols = self._columns[:width]
        slots = self.ctx.page_table[rows.view(-1, 1), (cols * ps).view(1, -1)]
        pages = slots if ps == 1 else torch.div(slots, ps, rounding_mode="floor")
        return torch.where(cols.view(1, -1) * ps < seq_lens.view(-1, 1), pages, 0).to(torch.int32)

    # --------------------------------------------------------------- metadata
    def _decode_metadata(self, tables: torch.Tensor, lens: torch.Tensor, max_seq_len: int) -> TrtllmMetadata:
        run = functools.partial(
            self.kernels.decode,
            workspace_buffer=self.workspace,
            block_tables=tables,
            seq_lens=lens,
            max_seq_len=max_seq_len,
            bmm1_scale=self.ctx.scale,
            bmm2_scale=1.0,
            kv_layout="NHD",
            enable_pdl=self.enable_pdl,
            backend=self.decode_kernel,
        )
        return TrtllmMetadata(run, tables, lens)

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.reqs
        n = len(reqs)
        kv_lens = [r.device_len for r in reqs]
        width = -(-max(kv_lens) // self.page_size)
        if batch.is_decode:
            dev = self._to_device([r.table_idx for r in reqs] + kv_lens)
            tables = self.block_tables(dev[:n], dev[n:], width)
            batch.attn_metadata = self._decode_metadata(tables, dev[n:], max(kv_lens))
            return
        if self.kernels.context is None:
            assert self.prefill_fallback is not None
            if not self._fallback_used:
                self._fallback_used = True
                logger.warning(
                    "trtllm-xqa runs prefill through the torch reference backend (slow); "
                    "pair it with a prefill backend: --attn flashinfer,trtllm-xqa"
                )
            self.prefill_fallback.prepare_metadata(batch)
            return
        cu_q, cu_kv = [0], [0]
        for r in reqs:
            cu_q.append(cu_q[-1] + r.extend_len)
            cu_kv.append(cu_kv[-1] + r.device_len)
        dev = self._to_device([r.table_idx for r in reqs] + kv_lens + cu_q + cu_kv)
        lens = dev[n : 2 * n]
        tables = self.block_tables(dev[:n], lens, width)
        run = functools.partial(
            self.kernels.context,
            workspace_buffer=self.workspace,
            block_tables=tables,
            seq_lens=lens,
            max_q_len=max(r.extend_len for r in reqs),
            max_kv_len=max(kv_lens),
            bmm1_scale=self.ctx.scale,
            bmm2_scale=1.0,
            batch_size=n,
            cum_seq_lens_q=dev[2 * n : 3 * n + 1],
            cum_seq_lens_kv=dev[3 * n + 1 :],
            kv_layout="NHD",
            enable_pdl=self.enable_pdl,
        )
        batch.attn_metadata = TrtllmMetadata(run, tables, lens)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        meta = batch.attn_metadata
        if not isinstance(meta, TrtllmMetadata):
            assert self.prefill_fallback is not None, "prepare_metadata was not called for this batch"
            return self.prefill_fallback.forward(q, k, v, layer_id, batch)
        c, pool = self.ctx, self.ctx.kv_pool
        assert batch.out_loc is not None
        hq, hkv, d = c.num_qo_heads, c.num_kv_heads, c.head_dim
        pool.store_kv(k.view(-1, hkv, d), v.view(-1, hkv, d), batch.out_loc, layer_id)
        query = q.reshape(-1, hq, d).contiguous()  # the kernels address q as a dense [tokens, heads, head_dim] array
        scales = self._layer_scales[layer_id] if self._layer_scales else {}
        out = meta.run(query=query, kv_cache=(pool.k_cache(layer_id), pool.v_cache(layer_id)), **scales)
        return out.view(-1, hq * d)

    # ------------------------------------------------------------ CUDA graphs
    def init_capture_graph(self, max_seq_len: int, batch_sizes: list[int]) -> None:
        max_bs = max(batch_sizes)
        width = -(-max_seq_len // self.page_size)
        if width > self._columns.numel():
            self._columns = torch.arange(width, dtype=torch.int32, device=self.ctx.device)
        # Shared by every graph (one replays at a time); as wide as the longest sequence,
        # so a captured kernel never needs a wider table.
        self._graph_tables = torch.zeros(max_bs, width, dtype=torch.int32, device=self.ctx.device)
        self._graph_lens = torch.ones(max_bs, dtype=torch.int32, device=self.ctx.device)
        self._graph_metadata = {}

    def prepare_for_capture(self, batch: Batch) -> None:
        assert self._graph_tables is not None and self._graph_lens is not None, "call init_capture_graph first"
        bs = batch.padded_size
        tables, lens = self._graph_tables[:bs], self._graph_lens[:bs]
        meta = self._decode_metadata(tables, lens, tables.shape[1] * self.page_size)
        self._graph_metadata[bs] = meta
        batch.attn_metadata = meta

    def prepare_for_replay(self, batch: Batch) -> None:
        assert self._graph_tables is not None and self._graph_lens is not None, "call init_capture_graph first"
        bs, n = batch.padded_size, batch.size
        dev = self._to_device([r.table_idx for r in batch.reqs] + [r.device_len for r in batch.reqs])
        self._graph_tables[:n].copy_(self.block_tables(dev[:n], dev[n:], self._graph_tables.shape[1]))
        self._graph_lens[:n].copy_(dev[n:])
        if bs > n:  # padding requests: one token on the scratch page
            self._graph_tables[n:bs].zero_()
            self._graph_lens[n:bs].fill_(1)
        batch.attn_metadata = self._graph_metadata[bs]


# ------------------------------------------------------------------ factories
def _check_shape(ctx: AttentionContext, name: str, page_sizes: tuple[int, ...], fp8_kv: bool = False) -> None:
    """ValueError (so that ``--attn auto`` moves on to the next backend) for what the kernels cannot run.
    ``fp8_kv``: the kernel also reads a float8 e4m3 pool."""
    if ctx.device.type != "cuda":
        raise ValueError(f"the {name} attention backend needs a CUDA device, got '{ctx.device}'; use --attn torch")
    kv_dtype = ctx.kv_pool.layout.dtype
    if ctx.dtype not in SUPPORTED_DTYPES or kv_dtype not in (ctx.dtype, *((FP8_KV_DTYPE,) if fp8_kv else ())):
        pools = "the model dtype or float8_e4m3fn" if fp8_kv else "the model dtype"
        raise ValueError(
            f"{name} backend: dtype {ctx.dtype} with a {kv_dtype} KV pool is not supported "
            f"(expected bfloat16 or float16, and a KV pool of {pools}); use --dtype bfloat16"
        )
    if ctx.head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{name} backend: head_dim {ctx.head_dim} is not supported (expected one of {SUPPORTED_HEAD_DIMS}); "
            "use --attn flashinfer or --attn torch for this model"
        )
    if ctx.page_size not in page_sizes:
        raise ValueError(
            f"{name} backend: page size {ctx.page_size} is not supported (expected one of {page_sizes}); "
            f"use --page-size {page_sizes[0]}"
        )
    k = ctx.kv_pool.k_cache(0)
    if tuple(k.shape[1:]) != (ctx.page_size, ctx.num_kv_heads, ctx.head_dim) or k.stride(-1) != 1:
        raise ValueError(
            f"{name} backend: the KV pool's pages are {tuple(k.shape[1:])} (stride {k.stride()}), expected "
            f"[page_size, kv_heads, head_dim] = {(ctx.page_size, ctx.num_kv_heads, ctx.head_dim)}, head_dim contiguous"
        )


def _check_device(ctx: AttentionContext, name: str, problem_of: Callable[[list[Any]], str | None]) -> None:
    problem = problem_of([torch.cuda.get_device_capability(ctx.device)])
    if problem:
        raise ValueError(f"{name} backend: {problem}")


def build_trtllm_gen(ctx: AttentionContext) -> TrtllmAttnBackend:
    """The ``trtllm`` backend: TensorRT-LLM-gen context (prefill) and decode kernels.

    Loads the kernels now, so that missing cubins (no ``flashinfer-cubin``, no
    ``FLASHINFER_CUBIN_DIR``, no network) fail here, where ``--attn auto`` can fall back.
    """
    _check_shape(ctx, "trtllm", TRTLLM_GEN_PAGE_SIZES)
    _check_device(ctx, "trtllm", trtllm_gen_problem)
    kernels = flashinfer_kernels(with_context=True)
    try:
        from flashinfer.prefill import get_trtllm_gen_fmha_module

        get_trtllm_gen_fmha_module()
    except Exception as exc:
        raise ValueError(
            "trtllm backend: FlashInfer could not load the TensorRT-LLM-gen kernels "
            f"({type(exc).__name__}: {exc}). Their cubins come from the flashinfer-cubin package, a folder named by "
            "FLASHINFER_CUBIN_DIR, or NVIDIA's artifactory at first use"
        ) from exc
    return TrtllmAttnBackend(ctx, kernels, decode="trtllm-gen")


def build_xqa(ctx: AttentionContext) -> TrtllmAttnBackend:
    """The ``trtllm-xqa`` backend: XQA decode kernel (a 16-bit or an FP8 KV cache); prefill through the torch
    reference."""
    _check_shape(ctx, "trtllm-xqa", XQA_PAGE_SIZES, fp8_kv=True)
    group = ctx.num_qo_heads // ctx.num_kv_heads
    if group > MAX_XQA_GROUP:
        raise ValueError(
            f"trtllm-xqa backend: {group} query heads per KV head is more than the {MAX_XQA_GROUP} it is built for; "
            "use --attn flashinfer"
        )
    _check_device(ctx, "trtllm-xqa", xqa_problem)
    kernels = flashinfer_kernels(with_context=False)
    _load_xqa_module(ctx, group)
    return TrtllmAttnBackend(ctx, kernels, decode="xqa")


def _load_xqa_module(ctx: AttentionContext, group: int) -> None:
    """Build XQA's module for this shape now (FlashInfer compiles it on first use, about 20 s, then caches it),
    so that a failure is a ValueError here, where ``--attn auto`` moves on, and not at the first decode."""
    dtype, kv_dtype = ctx.dtype, ctx.kv_pool.layout.dtype
    try:
        from flashinfer.xqa import get_xqa_module

        # The arguments FlashInfer's own call passes: query, cache, page size, head size, group, no sliding
        # window, output dtype (functools.cache'd, so that call finds it).
        get_xqa_module(dtype, kv_dtype, ctx.page_size, ctx.head_dim, group, False, dtype)
    except Exception as exc:
        raise ValueError(
            f"trtllm-xqa backend: FlashInfer could not build its XQA module for {dtype} queries over a {kv_dtype} "
            f"cache, page size {ctx.page_size}, head_dim {ctx.head_dim}, {group} query heads per KV head "
            f"({type(exc).__name__}: {exc}); FlashInfer compiles it with nvcc on first use"
        ) from exc
