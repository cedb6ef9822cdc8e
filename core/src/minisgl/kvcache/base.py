"""Interfaces of the KV pool and the prefix cache (the full contract: docs/plugin-contracts.md)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..kernel import quantize_kv as quantize_kv  # re-exported: minisgl.kvcache.quantize_kv

if TYPE_CHECKING:
    from ..kernel import KernelSet

#: Quantized KV cache dtypes by setting name (``--kv-cache-dtype``); ``auto`` stores the model dtype.
#: ``fp8_e4m3`` keeps 3 mantissa bits over +-448 (the usual choice, with scales); ``fp8_e5m2`` 2 bits over +-57,344.
QUANTIZED_KV_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_dtype_name(dtype: torch.dtype) -> str:
    """``fp8_e4m3`` / ``fp8_e5m2`` for a quantized KV dtype, else the torch name (``bfloat16``)."""
    names = {d: n for n, d in QUANTIZED_KV_DTYPES.items()}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def dequantize_kv(cache: torch.Tensor, slots: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``slots`` of a quantized ``[slots, heads, d]`` cache, times ``scale``, in ``dtype``. The rows are
    gathered as bytes: not every device has an ``index_select`` for float8."""
    rows = cache.view(torch.uint8).index_select(0, slots).view(cache.dtype).to(dtype)
    return rows if scale == 1.0 else rows * scale


@dataclass(frozen=True)
class KVLayout:
    """Shape of a KV pool: what a pool factory is built from. ``dtype`` is what the pool stores: the model
    dtype, or a quantized one (:data:`QUANTIZED_KV_DTYPES`), whose values are ``k / k_scales[layer]``
    (``v`` likewise; no scales: 1.0 for every layer)."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    kernels: KernelSet | None = None  # what ``store_kv`` runs; None: the PyTorch reference KernelSet
    k_scales: tuple[float, ...] = ()  # per layer, for a quantized dtype; () = 1.0 everywhere
    v_scales: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("k_scales", "v_scales"):
            scales = getattr(self, name)
            if scales and len(scales) != self.num_layers:
                raise ValueError(f"KVLayout.{name} has {len(scales)} entries for {self.num_layers} layers")
            if any(not (s > 0 and s < float("inf")) for s in scales):
                raise ValueError(f"KVLayout.{name} must be positive and finite, got {scales}")

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def quantized(self) -> bool:
        """Whether the pool stores scaled values in a quantized dtype (read them through the scales)."""
        return self.dtype in QUANTIZED_KV_DTYPES.values()

    def kv_scales(self, layer: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of ``layer``: stored value times scale is the real value."""
        return (self.k_scales[layer] if self.k_scales else 1.0, self.v_scales[layer] if self.v_scales else 1.0)

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class BaseKVPool(ABC):
    """Preallocated K/V storage addressed by token slot (``page * page_size + offset``)."""

    layout: KVLayout

    @abstractmethod
    def k_cache(self, layer: int) -> torch.Tensor:
        """Keys of one layer, ``[num_pages, page_size, num_kv_heads, head_dim]``."""

    @abstractmethod
    def v_cache(self, layer: int) -> torch.Tensor:
        """Values of one layer, shaped like :meth:`k_cache`."""

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer: int) -> None:
        """Write ``k``/``v`` (``[tokens, kv_heads, head_dim]``) into slots ``out_loc``; a quantized layout
        stores :func:`quantize_kv` of them with the layer's scales."""


@dataclass
class PrefixMatch:
    """``slots`` of the first ``len(slots)`` tokens (page-aligned); ``handle`` is what lock/unlock take."""

    handle: Any
    slots: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.slots.numel())


class BasePrefixCache(ABC):
    """Maps page-aligned token prefixes to the KV slots it owns (whole pages). It never frees anything:
    :meth:`evict` returns the slots it gave up and the caller returns their pages to the allocator."""

    page_size: int
    #: Whether inserted prefixes are matched later; only then does the scheduler hold a request back
    #: for a step while another request of the batch computes a longer prefix of it.
    reuses_prefixes: bool = True

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached page-aligned prefix of ``token_ids``."""

    @abstractmethod
    def lock(self, handle: Any) -> None:
        """Protect the matched prefix from eviction while a request uses it."""

    @abstractmethod
    def unlock(self, handle: Any) -> None:
        """Undo one :meth:`lock`."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Offer page-aligned ``token_ids`` with their ``slots``; returns ``n``: the cache now owns
        ``slots[n:]``, the caller keeps ``slots[:n]`` (tokens already held, or a cache that keeps nothing)."""

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Give up at least ``num_tokens`` unlocked slots if possible; return them."""

    @property
    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held by the cache and not locked by any request."""

    @property
    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held by the cache and locked by at least one request."""

    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def all_slots(self) -> torch.Tensor:
        """Every slot the cache owns (for accounting checks)."""
        return torch.empty(0, dtype=torch.int64)

    def check_integrity(self) -> None:
        """Raise AssertionError if internal invariants do not hold."""
        return None  # a cache with no internal structure has nothing to check

    def reset(self) -> torch.Tensor:
        """Drop everything unlocked; return the freed slots."""
        return self.evict(self.evictable_size)
