"""The two FlashInfer 0.5.3 entry points the backend calls, emulated in PyTorch (any device, any dtype).

Same parameter names and defaults as ``flashinfer.decode.trtllm_batch_decode_with_kv_cache``
and ``flashinfer.prefill.trtllm_batch_context_with_kv_cache`` (a GPU test compares
the signatures), and strict about the contract the real kernels rely on without
checking it: dtypes and shapes of the block table, lengths and cumulative lengths,
a dense query, in-range page indices, a table wide enough for XQA (which takes
its maximum length from the table's width). The attention itself is plain causal
attention of each request's new tokens over its whole KV, the new tokens last:
``bmm1_scale`` scales the scores and ``bmm2_scale`` the output, over the cache's
raw values (for an FP8 cache, its stored ``k / k_scale`` and ``v / v_scale``).

``EmulatedKernels(fp8_rounding=True)`` also rounds as XQA's FP8 tensor-core path does over an FP8
cache: the query and the unnormalised probabilities become e4m3 before their products (the sum that
normalises stays float32). The products themselves accumulate in float32 either way.
"""

from __future__ import annotations

import torch


def _check_lengths(block_tables: torch.Tensor, seq_lens: torch.Tensor, batch: int, num_pages: int) -> None:
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32, (block_tables.dtype, seq_lens.dtype)
    assert block_tables.dim() == 2 and block_tables.shape[0] == batch and block_tables.is_contiguous()
    assert seq_lens.shape == (batch,), seq_lens.shape
    assert bool((seq_lens >= 1).all())
    assert int(block_tables.min()) >= 0 and int(block_tables.max()) < num_pages, "page index out of the pool"


def _attend(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    q_lens: list[int],
    scale: float,
    fp8_rounding: bool = False,
) -> torch.Tensor:
    ps, hkv, d = k_cache.shape[1:]
    e4m3 = torch.float8_e4m3fn
    hq = query.shape[1]
    out = torch.empty_like(query)
    start = 0
    for b, (kv_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        pages = block_tables[b, : -(-kv_len // ps)].long()
        k = k_cache[pages].reshape(-1, hkv, d)[:kv_len].float().repeat_interleave(hq // hkv, dim=1)
        v = v_cache[pages].reshape(-1, hkv, d)[:kv_len].float().repeat_interleave(hq // hkv, dim=1)
        q = query[start : start + q_len].float()
        if fp8_rounding:
            q = q.to(e4m3).float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        pos = torch.arange(kv_len - q_len, kv_len, device=query.device).view(-1, 1)
        allowed = torch.arange(kv_len, device=query.device).view(1, -1) <= pos
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        total = weights.sum(dim=-1, keepdim=True)
        if fp8_rounding:
            weights = weights.to(e4m3).float()
        out[start : start + q_len] = (torch.einsum("hqk,khd->qhd", weights, v) / total.permute(1, 0, 2)).to(query.dtype)
        start += q_len
    return out


class EmulatedKernels:
    """``decode`` and ``context`` with FlashInfer's signatures; ``calls`` counts calls per kernel family."""

    def __init__(self, fp8_rounding: bool = False) -> None:
        self.calls: dict[str, int] = {}
        self.fp8_rounding = fp8_rounding

    def trtllm_batch_decode_with_kv_cache(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        workspace_buffer: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        bmm1_scale: float | torch.Tensor = 1.0,
        bmm2_scale: float | torch.Tensor = 1.0,
        window_left: int = -1,
        out: torch.Tensor | None = None,
        out_dtype: torch.dtype | str | None = None,
        o_sf_scale: float | None = None,
        o_sf_vec_size: int | None = None,
        sinks: list[torch.Tensor] | None = None,
        kv_layout: str = "HND",
        enable_pdl: bool | None = None,
        backend: str = "auto",
        q_len_per_req: int | None = 1,
        o_scale: float | None = 1.0,
    ) -> torch.Tensor:
        assert backend in ("trtllm-gen", "xqa"), backend
        assert kv_layout == "NHD" and isinstance(kv_cache, tuple)
        assert window_left == -1 and out is None and sinks is None and q_len_per_req == 1
        assert workspace_buffer.dtype == torch.uint8
        k_cache, v_cache = kv_cache
        batch = query.shape[0]
        assert query.dim() == 3 and query.is_contiguous()
        _check_lengths(block_tables, seq_lens, batch, k_cache.shape[0])
        lens = seq_lens.tolist()
        if backend == "xqa":  # XQA's maximum length is the table's width in tokens
            assert block_tables.shape[1] * k_cache.shape[1] >= max(lens)
        else:
            assert max_seq_len >= max(lens)
        self.calls[backend] = self.calls.get(backend, 0) + 1
        fp8 = self.fp8_rounding and k_cache.dtype == torch.float8_e4m3fn
        out = _attend(query, k_cache, v_cache, block_tables, lens, [1] * batch, float(bmm1_scale), fp8)
        return out * float(bmm2_scale)

    def trtllm_batch_context_with_kv_cache(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        workspace_buffer: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_q_len: int,
        max_kv_len: int,
        bmm1_scale: float | torch.Tensor,
        bmm2_scale: float | torch.Tensor,
        batch_size: int,
        cum_seq_lens_q: torch.Tensor,
        cum_seq_lens_kv: torch.Tensor,
        window_left: int = -1,
        out: torch.Tensor | None = None,
        out_dtype: torch.dtype | str | None = None,
        o_sf_scale: float | None = None,
        o_sf_vec_size: int | None = None,
        kv_layout: str = "HND",
        enable_pdl: bool | None = None,
        sinks: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        assert kv_layout == "NHD" and isinstance(kv_cache, tuple)
        assert window_left == -1 and out is None and sinks is None
        assert workspace_buffer.dtype == torch.uint8
        k_cache, v_cache = kv_cache
        assert query.dim() == 3 and query.is_contiguous()
        _check_lengths(block_tables, seq_lens, batch_size, k_cache.shape[0])
        assert cum_seq_lens_q.dtype == torch.int32 and cum_seq_lens_kv.dtype == torch.int32
        cu_q, cu_kv, lens = cum_seq_lens_q.tolist(), cum_seq_lens_kv.tolist(), seq_lens.tolist()
        q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
        assert len(cu_q) == batch_size + 1 and cu_q[0] == 0 and cu_q[-1] == query.shape[0]
        assert cu_kv == [sum(lens[:i]) for i in range(batch_size + 1)]
        assert max(q_lens) == max_q_len and max(lens) == max_kv_len
        assert all(1 <= q <= kv for q, kv in zip(q_lens, lens))
        assert block_tables.shape[1] * k_cache.shape[1] >= max(lens)
        self.calls["context"] = self.calls.get("context", 0) + 1
        out = _attend(query, k_cache, v_cache, block_tables, lens, q_lens, float(bmm1_scale))
        return out * float(bmm2_scale)
