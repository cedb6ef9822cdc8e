"""Paged attention through FlashInfer: prefill (ragged new tokens over the cache) and decode.

The KV pool keeps one ``[num_pages, page_size, kv_heads, head_dim]`` buffer per
layer for K and one for V, which is FlashInfer's ``NHD`` paged layout, so the
kernels read the pool in place. The page table holds token slots per request
row; a request's page list is every ``page_size``-th slot divided by the page
size, gathered on the device so that metadata preparation never waits for it.

Per batch, the wrapper is planned once (``prepare_metadata``) and then run by
every layer. Host-side inputs to ``plan`` (index pointers, last-page lengths)
stay on the CPU, which is what FlashInfer's scheduler reads; only the page
indices live on the device.

A wrapper's plan is written into one page-locked host buffer of the wrapper and copied to the device
asynchronously, in stream order. A wrapper is therefore planned again only once the copy of its previous plan
has run (an event per wrapper). Otherwise a host running steps ahead of the device rewrites that buffer before
the copy reads it, and the earlier step runs with the later step's plan. The host runs ahead when steps sample
nothing: the chunks of a long prompt with nothing else running.

An FP8 KV pool (``--kv-cache-dtype fp8_e4m3`` or ``fp8_e5m2``) is planned with ``kv_data_type``
that float8 dtype and run with the layer's scales: FlashInfer folds ``k_scale`` into the
softmax scale and multiplies the output by ``v_scale`` (a scale of 1.0 is not
passed, which saves that multiplication).

With ``ragged_prefill`` (or ``MINISGL_FLASHINFER_RAGGED=1``), prompts with nothing cached (no prefix-cache
hit, the first chunk) that end a prefill or mixed batch, where the scheduler puts its new requests, attend over
their own K/V as the layer computed them, through FlashInfer's ragged prefill, instead of reading them back from
the pool: the pool write still happens (later steps read it), but the kernel skips the page gather and, over an
FP8 cache, the de-quantization, which made paged prefill twice as slow as over a bf16 cache (``gpu_probe.py
prefill``: 347 against 156 microseconds a layer for fifteen 600-token prompts, Qwen3-8B's heads, H100). The rows
before them (decode rows, later chunks, prefix hits) keep the paged kernel, into the same output. Over an FP8
cache those prompts' attention is then that of their unquantized K/V, as in vLLM and SGLang (the conformance kit
allows exactly that). It is off by default: end to end (Qwen3-8B shapes, the offline workload, H100, 2026-12-07)
it gave nothing in bf16 (7,730 against 7,717 tok/s), and beside TensorRT-LLM's XQA decode over an FP8 cache
(``--attn auto``'s pair on Hopper) the run took 2.7 times as long (4,531 against 12,205 tok/s, two rounds).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.attention import AttentionContext, BaseAttnBackend
from minisgl.core import Batch, Req
from minisgl.kvcache import QUANTIZED_KV_DTYPES

from .plugin import KV_CACHE_DTYPES

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_KV_DTYPES = tuple(QUANTIZED_KV_DTYPES[name] for name in KV_CACHE_DTYPES)  # besides the model dtype
WORKSPACE_BYTES = 256 << 20


@dataclass
class FlashInferMetadata:
    """The planned wrappers that every layer of this batch runs.

    ``decode`` (a mixed batch with ``split_decode``) computes its first ``decode_tokens`` tokens, the decoding
    rows, one token each; ``wrapper`` (paged, decode or prefill) the tokens after them up to ``paged_tokens``,
    all the others when ``ragged`` is None; ``ragged`` the rest, over the K/V given to ``forward``. ``wrapper``
    is None when no row is left to it.
    """

    wrapper: Any
    ragged: Any = None
    paged_tokens: int = 0
    decode: Any = None
    decode_tokens: int = 0

    @property
    def single(self) -> bool:
        """Whether ``wrapper`` computes every token (one kernel, written to a fresh output)."""
        return self.ragged is None and self.decode is None


class FlashInferAttnBackend(BaseAttnBackend):
    """FlashInfer prefill and decode over the paged KV pool; decode can be captured in CUDA graphs.

    ``use_tensor_cores`` selects FlashInfer's tensor-core decode kernels; by
    default they are used whenever each KV head serves two or more query heads.
    On an H200 (16 query / 8 KV heads, head_dim 128, 600-2,000-token contexts)
    they read the cache at 4.15 TB/s against 3.65 TB/s for the CUDA-core kernel
    at batch 256 (docs/benchmarks/gpu-probe-attention.json). ``MINISGL_FLASHINFER_TENSOR_CORES`` (``1``/``0``;
    unset or ``auto``: the default rule) overrides the rule for every engine of the process, for comparisons
    such as an FP8 KV cache's decode with either kernel.
    """

    supports_cuda_graph = True
    supports_attend_stored = True  # the prefill graphs store K/V inside their pieces

    def __init__(
        self,
        ctx: AttentionContext,
        *,
        use_tensor_cores: bool | None = None,
        ragged_prefill: bool | None = None,
        split_decode: bool | None = None,
    ):
        if ctx.device.type != "cuda":
            raise ValueError(
                f"the flashinfer attention backend needs a CUDA device, got '{ctx.device}'; use --attn torch"
            )
        if ctx.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"flashinfer backend: head_dim {ctx.head_dim} is not supported (expected one of "
                f"{SUPPORTED_HEAD_DIMS}); use --attn torch for this model"
            )
        if ctx.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"flashinfer backend: dtype {ctx.dtype} is not supported; use --dtype bfloat16 or float16")
        layout = ctx.kv_pool.layout
        if layout.dtype != ctx.dtype and layout.dtype not in SUPPORTED_KV_DTYPES:
            raise ValueError(
                f"flashinfer backend: a {layout.dtype} KV cache is not supported (the model dtype, or "
                f"--kv-cache-dtype {' or '.join(KV_CACHE_DTYPES)})"
            )
        import flashinfer  # the kernel library is imported only when the backend is built

        self.ctx = ctx
        self._fi = flashinfer
        self.page_size = ctx.page_size
        group = ctx.num_qo_heads // ctx.num_kv_heads
        if use_tensor_cores is None:
            use_tensor_cores = _flag_from_env("MINISGL_FLASHINFER_TENSOR_CORES")
        self.use_tensor_cores = group >= 2 if use_tensor_cores is None else use_tensor_cores
        self.ragged_prefill = ragged_prefill_setting(ragged_prefill)
        self.split_decode = split_decode_setting(split_decode)
        # One float workspace shared by every wrapper: only one of them runs at a time (one stream).
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        # Each wrapper keeps its own plan (and integer workspace), so both can be planned for one batch.
        self.ragged_wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self.graph_wrappers: dict[int, Any] = {}
        # Per layer: the keyword arguments of run() that apply the KV scales (none for an unquantized cache).
        self._scale_args: list[dict[str, float]] = [
            _scale_args(*layout.kv_scales(i)) if layout.quantized else {} for i in range(layout.num_layers)
        ]
        self._arange_cache = torch.arange(0, dtype=torch.int64, device=ctx.device)
        # Per wrapper (by id): the event after the copy of its last plan.
        self._plan_copied: dict[int, torch.cuda.Event] = {}

    # ------------------------------------------------------------ page lists
    def _arange(self, n: int) -> torch.Tensor:
        if self._arange_cache.numel() < n:
            self._arange_cache = torch.arange(max(n, 2 * self._arange_cache.numel()), device=self.ctx.device)
        return self._arange_cache[:n]

    def _page_lists(self, reqs: list[Req], pad_to: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indptr on CPU, page indices on the device, last-page lengths on CPU) of ``reqs``, int32.

        With ``pad_to`` > ``len(reqs)``, the extra entries are one-token requests on
        the scratch page 0 (for a padded CUDA-graph batch).
        """
        ps = self.page_size
        n = len(reqs)
        lens = [r.device_len for r in reqs]
        counts = [(x + ps - 1) // ps for x in lens]
        pad = max(0, pad_to - n)
        indptr = list(itertools.accumulate(counts + [1] * pad, initial=0))
        last = [x - (c - 1) * ps for x, c in zip(lens, counts, strict=False)] + [1] * pad
        total = indptr[-1]
        real = indptr[n]
        # Rows, first-page offsets and counts travel to the device in one pinned copy.
        host = torch.tensor([r.table_idx for r in reqs] + indptr[:n] + counts, dtype=torch.int64, pin_memory=True)
        dev = host.to(self.ctx.device, non_blocking=True)
        rows, starts, cnt = dev[:n], dev[n : 2 * n], dev[2 * n :]
        req_of = torch.repeat_interleave(self._arange(n), cnt, output_size=real)
        local = self._arange(real) - starts[req_of]
        slots = self.ctx.page_table[rows[req_of], local * ps if ps > 1 else local]
        pages = slots if ps == 1 else slots // ps
        if pad:
            pages = torch.cat([pages, pages.new_zeros(total - real)])
        return torch.tensor(indptr, dtype=torch.int32), pages.to(torch.int32), torch.tensor(last, dtype=torch.int32)

    # -------------------------------------------------------------- planning
    def _plan(self, wrapper: Any, *args: Any, **kwargs: Any) -> None:
        """``wrapper.plan(*args, **kwargs)`` once the copy of the wrapper's previous plan has run (see the
        module's docstring); an event recorded after it marks this plan's copy."""
        done = self._plan_copied.get(id(wrapper))
        if done is not None:
            done.synchronize()
        wrapper.plan(*args, **kwargs)
        event = torch.cuda.Event()
        event.record()
        self._plan_copied[id(wrapper)] = event

    def _plan_decode(self, wrapper: Any, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor) -> None:
        c = self.ctx
        self._plan(
            wrapper,
            indptr,
            indices,
            last,
            c.num_qo_heads,
            c.num_kv_heads,
            c.head_dim,
            self.page_size,
            q_data_type=c.dtype,
            kv_data_type=c.kv_pool.layout.dtype,
            sm_scale=c.scale,
            non_blocking=True,
        )

    def prepare_metadata(self, batch: Batch) -> None:
        c = self.ctx
        if batch.is_decode:
            self._plan_decode(self.decode_wrapper, *self._page_lists(batch.reqs))
            batch.attn_metadata = FlashInferMetadata(self.decode_wrapper)
            return
        reqs = batch.reqs
        meta = FlashInferMetadata(None)
        first = decode_rows(reqs) if self.split_decode else 0
        if 0 < first < len(reqs):
            self._plan_decode(self.decode_wrapper, *self._page_lists(reqs[:first]))
            meta.decode, meta.decode_tokens = self.decode_wrapper, first
            reqs = reqs[first:]
        else:
            first = 0
        split = ragged_split(reqs) if self.ragged_prefill else len(reqs)
        if split < len(reqs):
            qo = _indptr(r.extend_len for r in reqs[split:])
            self._plan(
                self.ragged_wrapper,
                qo,
                qo,
                c.num_qo_heads,
                c.num_kv_heads,
                c.head_dim,
                causal=True,
                sm_scale=c.scale,
                q_data_type=c.dtype,
                non_blocking=True,
            )
            meta.ragged = self.ragged_wrapper
        if split > 0:
            paged = reqs[:split]
            paged_qo = _indptr(r.extend_len for r in paged)
            self._plan(
                self.prefill_wrapper,
                paged_qo,
                *self._page_lists(paged),
                c.num_qo_heads,
                c.num_kv_heads,
                c.head_dim,
                self.page_size,
                causal=True,  # bottom-right aligned: new tokens see the whole cached prefix
                sm_scale=c.scale,
                q_data_type=c.dtype,
                kv_data_type=c.kv_pool.layout.dtype,
                non_blocking=True,
            )
            meta.wrapper = self.prefill_wrapper
            meta.paged_tokens = first + int(paged_qo[-1])
        else:
            meta.paged_tokens = first
        batch.attn_metadata = meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        c, meta = self.ctx, batch.attn_metadata
        assert isinstance(meta, FlashInferMetadata) and batch.out_loc is not None
        hq, hkv, d = c.num_qo_heads, c.num_kv_heads, c.head_dim
        k, v = k.view(-1, hkv, d), v.view(-1, hkv, d)
        c.kv_pool.store_kv(k, v, batch.out_loc, layer_id)
        out = torch.empty((q.shape[0], hq * d), dtype=q.dtype, device=q.device)
        self._attend(meta, q.view(-1, hq, d), k, v, layer_id, out.view(-1, hq, d))
        return out

    def attend_stored(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch, out: torch.Tensor
    ) -> None:
        meta, c = batch.attn_metadata, self.ctx
        assert isinstance(meta, FlashInferMetadata)
        hq, hkv, d = c.num_qo_heads, c.num_kv_heads, c.head_dim
        self._attend(meta, q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d), layer_id, out.view(-1, hq, d))

    def _attend(
        self,
        meta: FlashInferMetadata,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        out: torch.Tensor,
    ) -> None:
        """The planned kernels over the pool (K/V of this step stored), into ``out`` (``[tokens, heads, d]``)."""
        pool, scales = self.ctx.kv_pool, self._scale_args[layer_id]
        kv = (pool.k_cache(layer_id), pool.v_cache(layer_id))
        if meta.single:
            meta.wrapper.run(q, kv, out=out, **scales)
            return
        s, t = meta.decode_tokens, meta.paged_tokens
        if meta.decode is not None:
            meta.decode.run(q[:s], kv, out=out[:s], **scales)
        if meta.wrapper is not None:
            meta.wrapper.run(q[s:t], kv, out=out[s:t], **scales)
        if meta.ragged is not None:
            meta.ragged.run(q[t:], k[t:], v[t:], out=out[t:])

    # ------------------------------------------------------------ CUDA graphs
    def init_capture_graph(self, max_seq_len: int, batch_sizes: list[int]) -> None:
        c = self.ctx
        max_bs = max(batch_sizes)
        max_pages = -(-max_seq_len // self.page_size)
        # Index buffers shared by every graph's wrapper: one graph replays at a time.
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=c.device)
        self._graph_indices = torch.zeros(max_bs * max_pages, dtype=torch.int32, device=c.device)
        self._graph_last = torch.ones(max_bs, dtype=torch.int32, device=c.device)
        for bs in batch_sizes:
            self.graph_wrappers[bs] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=self._graph_indptr[: bs + 1],
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=self._graph_last[:bs],
            )

    def prepare_for_capture(self, batch: Batch) -> None:
        bs = batch.padded_size
        wrapper = self.graph_wrappers[bs]
        indptr = torch.arange(bs + 1, dtype=torch.int32)
        indices = torch.zeros(bs, dtype=torch.int32, device=self.ctx.device)
        self._plan_decode(wrapper, indptr, indices, torch.ones(bs, dtype=torch.int32))
        batch.attn_metadata = FlashInferMetadata(wrapper)

    def prepare_for_replay(self, batch: Batch) -> None:
        wrapper = self.graph_wrappers[batch.padded_size]
        self._plan_decode(wrapper, *self._page_lists(batch.reqs, pad_to=batch.padded_size))
        batch.attn_metadata = FlashInferMetadata(wrapper)


def _scale_args(k_scale: float, v_scale: float) -> dict[str, float]:
    """``k_scale``/``v_scale`` for ``run()``, leaving out those equal to 1.0."""
    return {name: value for name, value in (("k_scale", k_scale), ("v_scale", v_scale)) if value != 1.0}


def ragged_split(reqs: list[Req]) -> int:
    """Where the prompts with nothing cached that end ``reqs`` begin: rows from there on attend over their own
    K/V (the ragged kernel); ``len(reqs)`` when the last row has something cached (a decode row, a later chunk,
    a prefix-cache hit)."""
    split = len(reqs)
    while split > 0 and reqs[split - 1].cached_len == 0:
        split -= 1
    return split


def decode_rows(reqs: list[Req]) -> int:
    """How many rows at the start of a mixed batch have one new token each (the decode kernel's shape): the
    scheduler puts its decoding requests first."""
    n = 0
    while n < len(reqs) and reqs[n].extend_len == 1:
        n += 1
    return n


def split_decode_setting(split_decode: bool | None) -> bool:
    """Whether a backend built with ``split_decode`` computes a mixed batch's decoding rows with the decode
    kernel: the argument when given, else ``MINISGL_FLASHINFER_SPLIT_DECODE``, else off."""
    return _off_unless_asked(split_decode, "MINISGL_FLASHINFER_SPLIT_DECODE")


def ragged_prefill_setting(ragged_prefill: bool | None) -> bool:
    """Whether a backend built with ``ragged_prefill`` prefills fresh prompts through the ragged kernel: the
    argument when given, else ``MINISGL_FLASHINFER_RAGGED``, else off (see the module's docstring)."""
    return _off_unless_asked(ragged_prefill, "MINISGL_FLASHINFER_RAGGED")


def _off_unless_asked(value: bool | None, env: str) -> bool:
    """An opt-in switch: ``value`` when given, else environment variable ``env`` (:func:`_flag_from_env`), else off."""
    return bool(_flag_from_env(env) if value is None else value)


def _indptr(lengths: Iterable[int]) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as an int32 CPU tensor (what FlashInfer's plan reads on the host)."""
    return torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32)


def _flag_from_env(name: str) -> bool | None:
    """A backend switch from environment variable ``name``: ``1``/``true``/``on`` or ``0``/``false``/``off``;
    unset, empty or ``auto``: None (the default rule). It applies to every engine of the process (for A/B runs)."""
    value = os.environ.get(name)
    text = (value or "auto").strip().lower()
    if text == "auto":
        return None
    if text in ("1", "true", "on", "yes"):
        return True
    if text in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name}={value!r}: expected 1, 0 or auto")
