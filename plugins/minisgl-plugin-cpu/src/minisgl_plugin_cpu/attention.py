"""Attention on CPU in float32 (the ``cpu`` backend): the reference's arithmetic, faster.

Decode batches run the native C kernel (:mod:`.native`), which reads each request's
K/V in place from the pool instead of gathering a padded copy. Other batches attend request by
request: a prompt with no cached prefix attends to its own new K/V (no gather) under
``is_causal``, which skips the upper triangle that the reference's padded, masked problem computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.attention import AttentionContext, TorchAttnBackend
from minisgl.core import Batch
from minisgl.plugins import Unsupported

from .native import load_cpu_kernels


def supported(device_type: str) -> bool:
    """The ``is_supported`` check of the backend and kernel set: CPU, with the C kernels built."""
    if device_type != "cpu":
        raise Unsupported("runs on CPU only")
    if load_cpu_kernels() is None:
        raise Unsupported("the native CPU kernels could not be built (no working C compiler; set $CC)")
    return True


@dataclass
class NativeDecodeMetadata:
    table_rows: torch.Tensor  # [B] int64: each request's page-table row
    kv_lens: torch.Tensor  # [B] int64


@dataclass
class PrefillRequest:
    """One request of a prefill batch: new tokens ``[q_start, q_start + q_len)`` of the flat batch."""

    q_start: int
    q_len: int
    kv_index: torch.Tensor  # [kv_len] token slots
    mask: torch.Tensor | None  # [q_len, kv_len] True where attention is allowed; None: all, or causal if no prefix
    no_prefix: bool  # the request's whole KV is this batch's new K/V


class CPUAttnBackend(TorchAttnBackend):
    def __init__(self, ctx: AttentionContext):
        super().__init__(ctx)
        k0, v0, table = ctx.kv_pool.k_cache(0), ctx.kv_pool.v_cache(0), ctx.page_table
        if ctx.device.type != "cpu" or not ctx.dtype == k0.dtype == v0.dtype == torch.float32:
            raise ValueError(
                f"the cpu attention backend runs float32 on CPU with a float32 KV cache, not {ctx.dtype} with a "
                f"{k0.dtype} cache on {ctx.device.type}; use --attn torch (it reads an FP8 KV cache too)"
            )
        if not (k0.is_contiguous() and v0.is_contiguous() and table.dtype == torch.int32 and table.stride(1) == 1):
            raise ValueError("the cpu attention backend needs a contiguous KV pool and an int32 page table")
        lib = load_cpu_kernels()
        if lib is None:
            raise ValueError("the cpu attention backend needs the native CPU kernels, which could not be built")
        self.lib = lib

    def prepare_metadata(self, batch: Batch) -> None:
        if all(r.extend_len == 1 for r in batch.reqs):
            batch.attn_metadata = NativeDecodeMetadata(
                torch.tensor([r.table_idx for r in batch.reqs], dtype=torch.int64),
                torch.tensor([r.device_len for r in batch.reqs], dtype=torch.int64),
            )
            return
        requests, q_start = [], 0
        for r in batch.reqs:
            kv_index = self.ctx.page_table[r.table_idx, : r.device_len].to(torch.int64)
            mask = None
            if r.cached_len > 0 and r.extend_len > 1:
                key_pos = torch.arange(r.device_len).view(1, -1)
                mask = key_pos <= torch.arange(r.cached_len, r.device_len).view(-1, 1)
            requests.append(PrefillRequest(q_start, r.extend_len, kv_index, mask, r.cached_len == 0))
            q_start += r.extend_len
        batch.attn_metadata = requests

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        ctx, meta = self.ctx, batch.attn_metadata
        assert batch.out_loc is not None
        hq, hkv, d = ctx.num_qo_heads, ctx.num_kv_heads, ctx.head_dim
        q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        ctx.kv_pool.store_kv(k, v, batch.out_loc, layer_id)
        if isinstance(meta, NativeDecodeMetadata):
            kv = ctx.kv_pool.k_cache(layer_id), ctx.kv_pool.v_cache(layer_id)
            return self.lib.decode_attention(q, *kv, ctx.page_table, meta.table_rows, meta.kv_lens, ctx.scale)
        outs = []
        for r in meta:
            rows = slice(r.q_start, r.q_start + r.q_len)
            if r.no_prefix:  # the new K/V as computed are what the pool holds (both float32)
                kr, vr = k[rows], v[rows]
            else:
                kr, vr = self.gather_kv(layer_id, r.kv_index, q.dtype)
            out = self.attend(q[rows][None], kr[None], vr[None], r.mask, causal=r.no_prefix and r.q_len > 1)
            outs.append(out[0].reshape(r.q_len, hq * d))
        return torch.cat(outs)
