"""Reference attention in plain PyTorch (CPU and CUDA), what every other backend is tested against: requests
padded into one ``[batch, max_new, heads, d]`` problem over their gathered K/V, one masked SDPA per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Batch
from ..kvcache import dequantize_kv
from .base import AttentionContext, BaseAttnBackend


@dataclass
class TorchAttnMetadata:
    kv_index: torch.Tensor  # [B * max_kv] token slots, row-major (padding points at scratch slot 0)
    mask: torch.Tensor  # [B, 1, max_q, max_kv] True where attention is allowed
    q_dest: torch.Tensor  # [T] row of each new token in the padded [B * max_q] query layout


class TorchAttnBackend(BaseAttnBackend):
    def __init__(self, ctx: AttentionContext):
        self.ctx = ctx

    def prepare_metadata(self, batch: Batch) -> None:
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
        kv_index = kv_index.masked_fill(key_pos[:, 0] >= kv_len_t[:, 0], 0)
        q_batch = torch.repeat_interleave(torch.arange(bsz, device=dev), torch.tensor(q_lens, device=dev))
        q_offset = torch.cat([torch.arange(n, device=dev) for n in q_lens])
        # Flat indices: index_select/index_copy on one dimension are far faster than
        # advanced indexing with two index tensors (which the CPU runs element by element).
        batch.attn_metadata = TorchAttnMetadata(kv_index.reshape(-1), mask.unsqueeze(1), q_batch * max_q + q_offset)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        ctx = self.ctx
        assert batch.out_loc is not None
        hkv, d = ctx.num_kv_heads, ctx.head_dim
        ctx.kv_pool.store_kv(k.view(-1, hkv, d), v.view(-1, hkv, d), batch.out_loc, layer_id)
        return self._over_pool(q, layer_id, batch)

    # Implemented, not advertised (``supports_attend_stored`` stays False): a subclass that overrides forward
    # with its own kernels would otherwise have the prefill graphs run this reference instead.
    def attend_stored(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch, out: torch.Tensor
    ) -> None:
        out.copy_(self._over_pool(q, layer_id, batch))

    def _over_pool(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        """Attention of ``q`` over the pool, this step's K/V stored."""
        ctx, meta = self.ctx, batch.attn_metadata
        assert isinstance(meta, TorchAttnMetadata)
        hq, hkv, d = ctx.num_qo_heads, ctx.num_kv_heads, ctx.head_dim
        bsz, _, max_q, max_kv = meta.mask.shape
        decode = max_q == 1  # one new token per request: the flat order is already the padded order
        if decode:
            qp = q.view(bsz, 1, hq, d)
        else:
            qp = q.new_zeros(bsz * max_q, hq, d).index_copy_(0, meta.q_dest, q.view(-1, hq, d))
            qp = qp.view(bsz, max_q, hq, d)
        kc, vc = (t.view(bsz, max_kv, hkv, d) for t in self.gather_kv(layer_id, meta.kv_index, q.dtype))
        out = self.attend(qp, kc, vc, mask=meta.mask).reshape(bsz * max_q, hq * d)
        return out if decode else out.index_select(0, meta.q_dest)

    def gather_kv(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` from the pool, ``[len(slots), kv_heads, d]`` in ``dtype`` (a quantized pool's
        values de-quantized: cast, times the layer's scale)."""
        pool, hkv, d = self.ctx.kv_pool, self.ctx.num_kv_heads, self.ctx.head_dim
        kc, vc = pool.k_cache(layer_id).reshape(-1, hkv, d), pool.v_cache(layer_id).reshape(-1, hkv, d)
        if pool.layout.quantized:
            k_scale, v_scale = pool.layout.kv_scales(layer_id)
            return dequantize_kv(kc, slots, k_scale, dtype), dequantize_kv(vc, slots, v_scale, dtype)
        return kc.index_select(0, slots).to(dtype), vc.index_select(0, slots).to(dtype)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool = False
    ) -> torch.Tensor:
        """SDPA over ``[B, tokens, heads, d]`` inputs (4-D: with 3-D ones SDPA on CPU takes its slow
        math path), returned in that layout."""
        ctx = self.ctx
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=causal,
            scale=ctx.scale,
            enable_gqa=ctx.num_qo_heads != ctx.num_kv_heads,
        )
        return out.transpose(1, 2)
