"""Stand-ins for the three FlashAttention libraries' paged calls, in plain PyTorch, for CPU tests.

Each stand-in has the keyword interface of the library function the adapter calls,
checks what the library checks (int32 metadata, page-table shape and contiguity,
paged K/V layout, no unexpected arguments), and computes paged attention the
way the library documents it: request ``b`` attends to the first ``seqused_k[b]``
tokens of the pages ``page_table[b]`` lists; causal masks align the queries to the
end of the sequence. Every call is recorded, so tests can see which path ran.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor


def _check_meta(name: str, t: Tensor, shape: tuple[int, ...]) -> None:
    assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    assert tuple(t.shape) == shape, f"{name} has shape {tuple(t.shape)}, expected {shape}"
    assert t.stride(-1) == 1, f"{name} must be contiguous in its last dimension"


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    seqused_k: Tensor,
    cu_seqlens_q: Tensor | None,
    causal: bool,
    scale: float,
) -> Tensor:
    """``q``: ``[tokens, heads, dim]`` with ``cu_seqlens_q``, or ``[batch, seqlen, heads, dim]`` without."""
    num_pages, page_size, hkv, d = k_cache.shape
    assert v_cache.shape == k_cache.shape
    batch = page_table.shape[0]
    _check_meta("page_table", page_table, (batch, page_table.shape[1]))
    _check_meta("seqused_k", seqused_k, (batch,))
    if cu_seqlens_q is not None:
        _check_meta("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
        bounds = cu_seqlens_q.tolist()
        chunks = [q[bounds[b] : bounds[b + 1]] for b in range(batch)]
    else:
        assert q.dim() == 4 and q.shape[0] == batch, f"batched q must be [batch, seqlen, heads, dim], got {q.shape}"
        chunks = list(q)
    out = []
    for b, qs in enumerate(chunks):
        n_k = int(seqused_k[b])
        used = -(-n_k // page_size)
        assert used <= page_table.shape[1], f"request {b}: {n_k} tokens need {used} pages, the table has fewer"
        pages = page_table[b, :used].long()
        assert bool(((pages >= 0) & (pages < num_pages)).all()), f"request {b}: page index out of range"
        k = k_cache[pages].reshape(-1, hkv, d)[:n_k].float()
        v = v_cache[pages].reshape(-1, hkv, d)[:n_k].float()
        group = qs.shape[1] // hkv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs.float(), k) * scale
        if causal:
            m = qs.shape[0]
            allowed = torch.arange(n_k).view(1, -1) <= (n_k - m + torch.arange(m)).view(-1, 1)
            scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype))
    return torch.cat(out) if cu_seqlens_q is not None else torch.stack(out)


def fa4_module(calls: list[str]) -> Any:
    """Stand-in for ``flash_attn.cute``."""

    def flash_attn_varlen_func(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens_q: Tensor | None = None,
        seqused_k: Tensor | None = None,
        page_table: Tensor | None = None,
        max_seqlen_q: int | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        **unused: Any,
    ) -> tuple[Tensor, None]:
        assert not unused, f"unexpected arguments {sorted(unused)}"
        assert page_table is not None and seqused_k is not None and softmax_scale is not None
        if cu_seqlens_q is not None:
            lens = cu_seqlens_q.diff()
            assert max_seqlen_q == int(lens.max()), f"max_seqlen_q {max_seqlen_q}, longest {int(lens.max())}"
        calls.append("varlen" if cu_seqlens_q is not None else "batched")
        out = paged_attention(q, k, v, page_table, seqused_k, cu_seqlens_q, causal, softmax_scale)
        return out, None

    return SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


def fa3_module(calls: list[str]) -> Any:
    """Stand-in for ``flash_attn_interface`` (FlashAttention 3)."""

    def flash_attn_with_kvcache(
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        cache_seqlens: Tensor | None = None,
        page_table: Tensor | None = None,
        cu_seqlens_q: Tensor | None = None,
        max_seqlen_q: int | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        **unused: Any,
    ) -> Tensor:
        assert not unused, f"unexpected arguments {sorted(unused)}"
        assert page_table is not None and cache_seqlens is not None and softmax_scale is not None
        assert (cu_seqlens_q is None) == (max_seqlen_q is None), "cu_seqlens_q needs max_seqlen_q"
        calls.append("varlen" if cu_seqlens_q is not None else "batched")
        return paged_attention(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, causal, softmax_scale)

    return SimpleNamespace(flash_attn_with_kvcache=flash_attn_with_kvcache)


def fa2_module(calls: list[str]) -> Any:
    """Stand-in for ``flash_attn`` 2.x (paged K/V only in pages of a multiple of 256 tokens)."""

    def flash_attn_varlen_func(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float | None = None,
        causal: bool = False,
        block_table: Tensor | None = None,
        **unused: Any,
    ) -> Tensor:
        assert not unused, f"unexpected arguments {sorted(unused)}"
        assert block_table is not None and softmax_scale is not None
        assert k.shape[1] % 256 == 0, "paged KV cache block size must be divisible by 256"
        _check_meta("cu_seqlens_k", cu_seqlens_k, (block_table.shape[0] + 1,))
        seqused = cu_seqlens_k.diff().to(torch.int32)
        assert int(seqused.max()) <= max_seqlen_k
        calls.append("varlen")
        return paged_attention(q, k, v, block_table, seqused, cu_seqlens_q, causal, softmax_scale)

    def flash_attn_with_kvcache(
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        cache_seqlens: Tensor | None = None,
        block_table: Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        **unused: Any,
    ) -> Tensor:
        assert not unused, f"unexpected arguments {sorted(unused)}"
        assert block_table is not None and cache_seqlens is not None and softmax_scale is not None
        assert k_cache.shape[1] % 256 == 0, "paged KV cache block size must be divisible by 256"
        calls.append("kvcache")
        return paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, None, causal, softmax_scale)

    return SimpleNamespace(
        flash_attn_varlen_func=flash_attn_varlen_func, flash_attn_with_kvcache=flash_attn_with_kvcache
    )
