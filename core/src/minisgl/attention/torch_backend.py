"""Reference attention in plain PyTorch: runs on CPU and CUDA.

Requests are padded into one ``[batch, heads, max_new, max_kv]`` problem and
solved with ``scaled_dot_product_attention`` under a causal-and-length mask.
It is the reference every other backend is tested against, not a fast path.

Decode batches on CPU in float32 use the core's native kernel
(:mod:`minisgl.kernel.cpu`), which reads each request's K/V in place from the
pool. Without it (no C compiler, other dtypes) they take a variant of the padded
computation: requests are sorted by KV length and split into a few groups, each
padded only to its own longest request. Gathering K/V and attending both cost in
proportion to the padded size, and decode lengths in a batch often differ
several-fold.

Prefill batches on CPU attend request by request instead: a prompt with no
cached prefix attends to its own new K/V (no gather) under ``is_causal``, which
lets the kernel skip the upper triangle that the padded, masked problem computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Batch
from ..kernel.cpu import CpuKernels, load_cpu_kernels
from .base import AttentionContext, BaseAttnBackend

# What one more decode length group costs (a few extra small ops per layer), in the
# padded KV tokens it would take to cost the same: measured on a 2-core CPU, SmolLM2-135M.
GROUP_OVERHEAD_TOKENS = 256


@dataclass
class TorchAttnMetadata:
    kv_index: torch.Tensor  # [B * max_kv] token slots, row-major (padding points at scratch slot 0)
    mask: torch.Tensor  # [B, 1, max_q, max_kv] True where attention is allowed
    q_dest: torch.Tensor  # [T] row of each new token in the padded [B * max_q] query layout
    batch_size: int
    max_q: int
    max_kv: int


@dataclass
class DecodeGroup:
    """Decode requests of similar KV length, attended as one problem padded to ``max_kv``."""

    rows: torch.Tensor | None  # positions of these requests in the batch; None: the whole batch, in order
    kv_index: torch.Tensor  # [size * max_kv] token slots (padding points at scratch slot 0)
    mask: torch.Tensor | None  # [size, 1, 1, max_kv]; None when every request has max_kv tokens
    size: int
    max_kv: int


@dataclass
class TorchDecodeMetadata:
    groups: list[DecodeGroup]
    batch_size: int


@dataclass
class NativeDecodeMetadata:
    """A decode batch for the native CPU kernel: each request's table row and KV length."""

    table_rows: torch.Tensor  # [B] int64
    kv_lens: torch.Tensor  # [B] int64


@dataclass
class PrefillRequest:
    """One request of a prefill batch: new tokens ``[q_start, q_start + q_len)`` of the flat batch."""

    q_start: int
    q_len: int
    kv_index: torch.Tensor  # [kv_len] token slots
    mask: torch.Tensor | None  # [q_len, kv_len] True where attention is allowed; None: all, or causal if no prefix
    no_prefix: bool  # the request's whole KV is this batch's new K/V


@dataclass
class TorchPrefillMetadata:
    requests: list[PrefillRequest]


def group_by_length(lengths: list[int], overhead: int = GROUP_OVERHEAD_TOKENS) -> list[list[int]]:
    """Split positions ``0..len(lengths)-1`` into groups of similar length.

    Minimises ``sum(len(group) * max length in group) + overhead * number of groups``
    over groups that are runs of the lengths in sorted order (exact, by dynamic
    programming; quadratic in the batch size). Groups come out shortest first.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    sorted_lens = [lengths[i] for i in order]
    n = len(order)
    best = [0] + [0] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        top = sorted_lens[j - 1]
        best[j], cut[j] = min((best[i] + overhead + (j - i) * top, i) for i in range(j))
    groups: list[list[int]] = []
    j = n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


class TorchAttnBackend(BaseAttnBackend):
    """``native_decode``: decode batches with the native CPU kernel (default: on where it can
    run: CPU, float32, a contiguous pool, kernels built); ``grouped_decode``: otherwise by
    length groups; ``per_request_prefill``: other batches request by request (both default
    to on for CPU only)."""

    def __init__(
        self,
        ctx: AttentionContext,
        grouped_decode: bool | None = None,
        per_request_prefill: bool | None = None,
        native_decode: bool | None = None,
    ):
        self.ctx = ctx
        cpu = ctx.device.type == "cpu"
        self.grouped_decode = cpu if grouped_decode is None else grouped_decode
        self.per_request_prefill = cpu if per_request_prefill is None else per_request_prefill
        self.native: CpuKernels | None = None
        if native_decode is not False:
            self.native = self._native_kernels()
            if native_decode and self.native is None:
                raise ValueError(
                    "native_decode needs CPU float32 attention over a contiguous KV pool and the native CPU "
                    "kernels (a C compiler; see minisgl.kernel.cpu)"
                )

    def _native_kernels(self) -> CpuKernels | None:
        ctx = self.ctx
        k0, v0 = ctx.kv_pool.k_cache(0), ctx.kv_pool.v_cache(0)
        if not CpuKernels.supports(k0, v0) or ctx.dtype != torch.float32 or ctx.page_table.dtype != torch.int32:
            return None
        if not (k0.is_contiguous() and v0.is_contiguous() and ctx.page_table.stride(1) == 1):
            return None
        return load_cpu_kernels()

    def prepare_metadata(self, batch: Batch) -> None:
        decode = all(r.extend_len == 1 for r in batch.reqs)
        if self.native is not None and decode:
            batch.attn_metadata = NativeDecodeMetadata(
                torch.tensor([r.table_idx for r in batch.reqs], dtype=torch.int64),
                torch.tensor([r.device_len for r in batch.reqs], dtype=torch.int64),
            )
            return
        if self.grouped_decode and decode:
            batch.attn_metadata = self._decode_metadata(batch)
            return
        if self.per_request_prefill:
            batch.attn_metadata = self._prefill_metadata(batch)
            return
        dev = self.ctx.device
        q_lens = [r.extend_len for r in batch.reqs]
        kv_lens = [r.device_len for r in batch.reqs]
        starts = [r.cached_len for r in batch.reqs]
        bsz, max_q, max_kv = len(batch.reqs), max(q_lens), max(kv_lens)
        rows = torch.tensor([r.table_idx for r in batch.reqs], dtype=torch.int64, device=dev)
        kv_index = self.ctx.page_table[rows, :max_kv].to(torch.int64)
        kv_len_t = torch.tensor(kv_lens, device=dev).view(bsz, 1, 1)
        start_t = torch.tensor(starts, device=dev).view(bsz, 1, 1)
        key_pos = torch.arange(max_kv, device=dev).view(1, 1, max_kv)
        q_pos = start_t + torch.arange(max_q, device=dev).view(1, max_q, 1)
        mask = (key_pos <= q_pos) & (key_pos < kv_len_t)
        kv_index = torch.where(key_pos[:, 0] < kv_len_t[:, 0], kv_index, torch.zeros_like(kv_index))
        q_batch = torch.repeat_interleave(torch.arange(bsz, device=dev), torch.tensor(q_lens, device=dev))
        q_offset = torch.cat([torch.arange(n, device=dev) for n in q_lens])
        # Flat indices: index_select/index_copy on one dimension are far faster than
        # advanced indexing with two index tensors (which the CPU runs element by element).
        batch.attn_metadata = TorchAttnMetadata(
            kv_index.reshape(-1), mask.unsqueeze(1), q_batch * max_q + q_offset, bsz, max_q, max_kv
        )

    def _prefill_metadata(self, batch: Batch) -> TorchPrefillMetadata:
        dev = self.ctx.device
        requests, q_start = [], 0
        for r in batch.reqs:
            kv_index = self.ctx.page_table[r.table_idx, : r.device_len].to(torch.int64)
            mask = None
            if r.cached_len > 0 and r.extend_len > 1:
                key_pos = torch.arange(r.device_len, device=dev).view(1, -1)
                q_pos = torch.arange(r.cached_len, r.device_len, device=dev).view(-1, 1)
                mask = key_pos <= q_pos
            requests.append(PrefillRequest(q_start, r.extend_len, kv_index, mask, r.cached_len == 0))
            q_start += r.extend_len
        return TorchPrefillMetadata(requests)

    def _decode_metadata(self, batch: Batch) -> TorchDecodeMetadata:
        dev = self.ctx.device
        kv_lens = [r.device_len for r in batch.reqs]
        parts = group_by_length(kv_lens, GROUP_OVERHEAD_TOKENS)
        if len(parts) == 1:
            parts = [list(range(len(kv_lens)))]  # one group: keep batch order, no reordering needed
        groups = []
        for part in parts:
            lens = [kv_lens[i] for i in part]
            max_kv = max(lens)
            table_rows = torch.tensor([batch.reqs[i].table_idx for i in part], dtype=torch.int64, device=dev)
            kv_index = self.ctx.page_table[table_rows, :max_kv].to(torch.int64)
            mask = None
            if min(lens) < max_kv:
                valid = torch.arange(max_kv, device=dev).view(1, max_kv) < torch.tensor(lens, device=dev).view(-1, 1)
                kv_index = torch.where(valid, kv_index, torch.zeros_like(kv_index))
                mask = valid.view(len(part), 1, 1, max_kv)
            rows = None if len(parts) == 1 else torch.tensor(part, dtype=torch.int64, device=dev)
            groups.append(DecodeGroup(rows, kv_index.reshape(-1), mask, len(part), max_kv))
        return TorchDecodeMetadata(groups, len(batch.reqs))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        ctx, meta = self.ctx, batch.attn_metadata
        assert batch.out_loc is not None
        hq, hkv, d = ctx.num_qo_heads, ctx.num_kv_heads, ctx.head_dim
        ctx.kv_pool.store_kv(k.view(-1, hkv, d), v.view(-1, hkv, d), batch.out_loc, layer_id)
        if isinstance(meta, NativeDecodeMetadata):
            assert self.native is not None
            pool = ctx.kv_pool
            return self.native.decode_attention(
                q.view(-1, hq, d),
                pool.k_cache(layer_id),
                pool.v_cache(layer_id),
                ctx.page_table,
                meta.table_rows,
                meta.kv_lens,
                ctx.scale,
            )
        if isinstance(meta, TorchDecodeMetadata):
            return self._forward_decode(q, layer_id, meta)
        if isinstance(meta, TorchPrefillMetadata):
            return self._forward_prefill(q, k, v, layer_id, meta)
        assert isinstance(meta, TorchAttnMetadata)
        bsz, max_q, max_kv = meta.batch_size, meta.max_q, meta.max_kv
        decode = max_q == 1  # one new token per request: the flat order is already the padded order
        if decode:
            qp = q.view(bsz, 1, hq, d)
        else:
            qp = q.new_zeros(bsz * max_q, hq, d).index_copy_(0, meta.q_dest, q.view(-1, hq, d))
            qp = qp.view(bsz, max_q, hq, d)
        out = self._attend(qp, layer_id, meta.kv_index, meta.mask, max_kv)
        return out if decode else out.index_select(0, meta.q_dest)

    def _forward_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, meta: TorchPrefillMetadata
    ) -> torch.Tensor:
        ctx = self.ctx
        hq, hkv, d = ctx.num_qo_heads, ctx.num_kv_heads, ctx.head_dim
        q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        k_cache, v_cache = ctx.kv_pool.k_cache(layer_id), ctx.kv_pool.v_cache(layer_id)
        # The new K/V as computed equal what the pool holds unless the pool stores another dtype.
        reuse_new = k.dtype == k_cache.dtype and v.dtype == v_cache.dtype
        outs = []
        for r in meta.requests:
            qr = q[r.q_start : r.q_start + r.q_len]
            if r.no_prefix and reuse_new:
                kr = k[r.q_start : r.q_start + r.q_len].to(qr.dtype)
                vr = v[r.q_start : r.q_start + r.q_len].to(qr.dtype)
            else:
                kr = k_cache.reshape(-1, hkv, d).index_select(0, r.kv_index).to(qr.dtype)
                vr = v_cache.reshape(-1, hkv, d).index_select(0, r.kv_index).to(qr.dtype)
            # 4-D inputs: with 3-D ones SDPA on CPU takes its slow math path instead of the flash kernel.
            out = F.scaled_dot_product_attention(
                qr.transpose(0, 1).unsqueeze(0),
                kr.transpose(0, 1).unsqueeze(0),
                vr.transpose(0, 1).unsqueeze(0),
                attn_mask=r.mask,
                is_causal=r.no_prefix and r.q_len > 1,
                scale=ctx.scale,
                enable_gqa=hq != hkv,
            )
            outs.append(out[0].transpose(0, 1).reshape(r.q_len, hq * d))
        return torch.cat(outs)

    def _forward_decode(self, q: torch.Tensor, layer_id: int, meta: TorchDecodeMetadata) -> torch.Tensor:
        hq, d = self.ctx.num_qo_heads, self.ctx.head_dim
        q = q.view(meta.batch_size, hq, d)
        if len(meta.groups) == 1 and meta.groups[0].rows is None:
            g = meta.groups[0]
            return self._attend(q.view(g.size, 1, hq, d), layer_id, g.kv_index, g.mask, g.max_kv)
        out = q.new_empty(meta.batch_size, hq * d)
        for g in meta.groups:
            assert g.rows is not None
            qg = q.index_select(0, g.rows).view(g.size, 1, hq, d)
            out.index_copy_(0, g.rows, self._attend(qg, layer_id, g.kv_index, g.mask, g.max_kv))
        return out

    def _attend(
        self, qp: torch.Tensor, layer_id: int, kv_index: torch.Tensor, mask: torch.Tensor | None, max_kv: int
    ) -> torch.Tensor:
        """Padded attention: ``qp`` ``[B, max_q, hq, d]`` over the gathered slots -> ``[B * max_q, hq * d]``."""
        ctx, pool = self.ctx, self.ctx.kv_pool
        hq, hkv, d = ctx.num_qo_heads, ctx.num_kv_heads, ctx.head_dim
        bsz, max_q = qp.shape[0], qp.shape[1]
        shape = (bsz, max_kv, hkv, d)
        kc = pool.k_cache(layer_id).reshape(-1, hkv, d).index_select(0, kv_index).view(shape).to(qp.dtype)
        vc = pool.v_cache(layer_id).reshape(-1, hkv, d).index_select(0, kv_index).view(shape).to(qp.dtype)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2),
            kc.transpose(1, 2),
            vc.transpose(1, 2),
            attn_mask=mask,
            scale=ctx.scale,
            enable_gqa=hq != hkv,
        )
        return out.transpose(1, 2).reshape(bsz * max_q, hq * d)
