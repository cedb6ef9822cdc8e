"""Interfaces of the KV cache pool and the prefix cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..kernel import KernelSet


@dataclass(frozen=True)
class KVLayout:
    """Shape of a KV pool: what a pool factory is built from."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    kernels: KernelSet | None = None  # what ``store_kv`` runs; None: select_kernels(device, dtype, "auto")

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


class BaseKVPool(ABC):
    """Preallocated K/V storage addressed by token slot (``page * page_size + offset``)."""

    layout: KVLayout

    @abstractmethod
    def k_cache(self, layer: int) -> torch.Tensor:
        """Keys of one layer, shaped ``[num_pages, page_size, num_kv_heads, head_dim]``."""

    @abstractmethod
    def v_cache(self, layer: int) -> torch.Tensor:
        """Values of one layer, shaped like :meth:`k_cache`."""

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer: int) -> None:
        """Write ``k``/``v`` (``[tokens, kv_heads, head_dim]``) into slots ``out_loc``."""


@dataclass
class PrefixMatch:
    """Result of :meth:`BasePrefixCache.match_prefix`.

    ``slots`` holds the KV slots of the first ``len(slots)`` tokens (a multiple
    of the page size); ``handle`` is what :meth:`BasePrefixCache.lock` and
    :meth:`BasePrefixCache.unlock` take.
    """

    handle: Any
    slots: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.slots.numel())


class BasePrefixCache(ABC):
    """Maps token prefixes to KV slots so later requests can skip computing them.

    All lengths are multiples of ``page_size``. Slots the cache owns are whole
    pages; the cache never frees anything itself: :meth:`evict` returns the
    slots it gave up and the caller returns their pages to the allocator.
    """

    page_size: int
    #: Whether inserted prefixes are matched later. The scheduler holds a request back for a step
    #: when another request of the batch is computing a longer prefix of it, which only pays off
    #: for a cache that keeps what it is given.
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
        """Offer ``token_ids`` (page-aligned length) with their ``slots`` to the cache.

        Returns ``n``: the cache keeps ``slots[n:]`` and takes ownership of them;
        ``slots[:n]`` were not taken (the cache already held those tokens, or it
        keeps nothing), so the caller still owns those it did not get from a match.
        """

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
