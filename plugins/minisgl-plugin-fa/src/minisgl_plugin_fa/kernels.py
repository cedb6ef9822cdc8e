"""One small adapter per FlashAttention generation, behind one interface.

Every adapter takes the same inputs, which is what minisgl's paged pool gives:

- ``k_cache``/``v_cache``: one layer of the pool, ``[num_pages, page_size, kv_heads, head_dim]``
  (FlashAttention's paged layout, read in place);
- ``page_table``: ``[batch, pages]`` int32, the pool pages of each request in order;
- ``seqused_k``: ``[batch]`` int32, how many tokens of its pages each request attends to
  (its cached prefix plus the new tokens, whose K/V are already stored);
- prefill: ``q`` ``[tokens, heads, head_dim]`` with ``cu_seqlens_q`` ``[batch + 1]`` int32
  and the longest extension ``max_seqlen_q``; new tokens attend causally, aligned to
  the end of the sequence (bottom-right), so they see the whole cached prefix;
- decode: ``q`` ``[batch, heads, head_dim]``, one new token per request.

Each returns the output in ``q``'s shape and dtype. The library is imported when
the adapter is built; tests pass a stand-in module instead.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


class FlashAttnKernels(ABC):
    """Paged prefill and decode through one FlashAttention generation."""

    generation: int
    module_name: str
    head_dims: tuple[int, ...] = (64, 96, 128, 192, 256)

    def __init__(self, module: ModuleType | None = None):
        self.lib: Any = module if module is not None else importlib.import_module(self.module_name)

    @property
    def label(self) -> str:
        """``FlashAttention 4 (flash_attn.cute)``: how messages name this adapter."""
        return f"FlashAttention {self.generation} ({self.module_name})"

    def problem(self, head_dim: int, dtype: torch.dtype, page_size: int) -> str | None:
        """Why this adapter cannot run a model of these shapes (``None``: it can)."""
        if head_dim not in self.head_dims:
            return f"head_dim {head_dim} is not supported by {self.label} (supported: {self.head_dims})"
        if dtype not in SUPPORTED_DTYPES:
            return f"{self.label} runs in bfloat16 or float16, not {dtype}; use --dtype bfloat16"
        return None

    @abstractmethod
    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        seqused_k: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        max_seqlen_q: int,
        scale: float,
    ) -> torch.Tensor:
        """New tokens of each request (ragged) attending causally over its pages."""

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        seqused_k: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One new token per request attending over its pages."""


def _first(result: Any) -> torch.Tensor:
    """The output of a call that returns either it or a tuple starting with it."""
    return result[0] if isinstance(result, tuple | list) else result


class FA4Kernels(FlashAttnKernels):
    """``flash-attn-4`` (CuTe DSL): ``flash_attn.cute.flash_attn_varlen_func`` with a page table.

    Kernels are compiled on first use for each shape family (a few seconds each)
    and kept for the process; ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` keeps
    them on disk across processes.
    """

    generation = 4
    module_name = "flash_attn.cute"
    head_dims = (64, 96, 128, 256)  # what both its sm90 and sm100 kernels take (192 only on sm90)

    def prefill(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        page_table: Tensor,
        seqused_k: Tensor,
        cu_seqlens_q: Tensor,
        max_seqlen_q: int,
        scale: float,
    ) -> Tensor:
        return _first(
            self.lib.flash_attn_varlen_func(
                q,
                k_cache,
                v_cache,
                cu_seqlens_q=cu_seqlens_q,
                seqused_k=seqused_k,
                page_table=page_table,
                max_seqlen_q=max_seqlen_q,
                softmax_scale=scale,
                causal=True,
            )
        )

    def decode(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, seqused_k: Tensor, scale: float
    ) -> Tensor:
        # One query row per request: the batched form (no cu_seqlens_q), causal masking is moot.
        out = self.lib.flash_attn_varlen_func(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            seqused_k=seqused_k,
            page_table=page_table,
            softmax_scale=scale,
            causal=False,
        )
        return _first(out).squeeze(1)


class FA3Kernels(FlashAttnKernels):
    """FlashAttention 3 (the ``hopper/`` build): ``flash_attn_interface.flash_attn_with_kvcache``."""

    generation = 3
    module_name = "flash_attn_interface"

    def prefill(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        page_table: Tensor,
        seqused_k: Tensor,
        cu_seqlens_q: Tensor,
        max_seqlen_q: int,
        scale: float,
    ) -> Tensor:
        return _first(
            self.lib.flash_attn_with_kvcache(
                q,
                k_cache,
                v_cache,
                cache_seqlens=seqused_k,
                page_table=page_table,
                cu_seqlens_q=cu_seqlens_q,
                max_seqlen_q=max_seqlen_q,
                softmax_scale=scale,
                causal=True,
            )
        )

    def decode(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, seqused_k: Tensor, scale: float
    ) -> Tensor:
        out = self.lib.flash_attn_with_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=seqused_k,
            page_table=page_table,
            softmax_scale=scale,
            causal=False,
        )
        return _first(out).squeeze(1)


class FA2Kernels(FlashAttnKernels):
    """``flash-attn`` 2.x: ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` with a
    ``block_table``, which flash-attn 2 accepts for pages of a multiple of 256 tokens only."""

    generation = 2
    module_name = "flash_attn"
    head_dims = (32, 64, 96, 128, 160, 192, 224, 256)

    def problem(self, head_dim: int, dtype: torch.dtype, page_size: int) -> str | None:
        if page_size % 256 != 0:
            return (
                f"{self.label} reads a paged KV cache only in pages of a multiple of 256 tokens (the page size "
                f"here is {page_size}); start with --page-size 256, or use --attn flashinfer"
            )
        return super().problem(head_dim, dtype, page_size)

    def prefill(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        page_table: Tensor,
        seqused_k: Tensor,
        cu_seqlens_q: Tensor,
        max_seqlen_q: int,
        scale: float,
    ) -> Tensor:
        cu_seqlens_k = torch.nn.functional.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))
        return _first(
            self.lib.flash_attn_varlen_func(
                q,
                k_cache,
                v_cache,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                page_table.shape[1] * k_cache.shape[1],
                softmax_scale=scale,
                causal=True,
                block_table=page_table,
            )
        )

    def decode(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, seqused_k: Tensor, scale: float
    ) -> Tensor:
        out = self.lib.flash_attn_with_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=seqused_k,
            block_table=page_table,
            softmax_scale=scale,
            causal=False,
        )
        return _first(out).squeeze(1)


KERNELS: dict[int, type[FlashAttnKernels]] = {2: FA2Kernels, 3: FA3Kernels, 4: FA4Kernels}
