"""The attention backend interface: per-step metadata, then attention per layer; backends that support CUDA
graphs also implement the capture/replay hooks (decode batches only). Contract: docs/plugin-contracts.md."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..core import Batch
from ..kvcache import BaseKVPool


@dataclass(frozen=True)
class AttentionContext:
    """What an attention backend factory is built from (per tensor-parallel rank)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kv_pool: BaseKVPool
    page_table: torch.Tensor  # [max_reqs, max_seq_len] int32 token slots, on ``device``
    max_batch_size: int
    max_seq_len: int
    dtype: torch.dtype
    device: torch.device

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


class BaseAttnBackend(ABC):
    """Paged attention over the KV pool: each request's new tokens, positions ``[req.cached_len,
    req.device_len)``, store their K/V at ``batch.out_loc``, then attend causally to everything before them."""

    supports_cuda_graph: bool = False
    #: Whether :meth:`attend_stored` is implemented. The prefill CUDA graphs then store each layer's K/V inside their
    #: captured pieces and call :meth:`attend_stored` between them, so only the attention kernels launch from Python.
    supports_attend_stored: bool = False

    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None:
        """Build per-batch metadata (stored in ``batch.attn_metadata``), once per step."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        """Store ``k``/``v`` and attend. ``q``: ``[tokens, qo_heads * head_dim]``; returns the same shape."""

    def attend_stored(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch, out: torch.Tensor
    ) -> None:
        """:meth:`forward` of a prefill or mixed batch whose ``k``/``v`` are already in the pool at
        ``batch.out_loc`` (stored by :meth:`~minisgl.kvcache.BaseKVPool.store_kv`), written into ``out``
        (``[tokens, qo_heads * head_dim]``) instead of a new tensor."""
        raise NotImplementedError(f"{type(self).__name__} does not implement attend_stored()")

    def init_capture_graph(self, max_seq_len: int, batch_sizes: list[int]) -> None:
        """Allocate static buffers for capturing decode graphs of these batch sizes."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch: Batch) -> None:
        """Set metadata for capturing a (dummy) decode batch of ``batch.padded_size``."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_replay(self, batch: Batch) -> None:
        """Update the static buffers in place for replaying ``batch`` padded to ``batch.padded_size``."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")


class HybridAttnBackend(BaseAttnBackend):
    """One backend for prefill batches and another for decode batches (``--attn P,D``)."""

    def __init__(self, prefill: BaseAttnBackend, decode: BaseAttnBackend):
        self.prefill, self.decode = prefill, decode
        self.supports_cuda_graph = decode.supports_cuda_graph
        self.supports_attend_stored = prefill.supports_attend_stored  # prefill graphs run prefill batches only

    def _pick(self, batch: Batch) -> BaseAttnBackend:
        return self.prefill if batch.is_prefill else self.decode

    def prepare_metadata(self, batch: Batch) -> None:
        self._pick(batch).prepare_metadata(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        return self._pick(batch).forward(q, k, v, layer_id, batch)

    def attend_stored(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch, out: torch.Tensor
    ) -> None:
        self._pick(batch).attend_stored(q, k, v, layer_id, batch, out)

    def init_capture_graph(self, max_seq_len: int, batch_sizes: list[int]) -> None:
        self.decode.init_capture_graph(max_seq_len, batch_sizes)

    def prepare_for_capture(self, batch: Batch) -> None:
        self.decode.prepare_for_capture(batch)

    def prepare_for_replay(self, batch: Batch) -> None:
        self.decode.prepare_for_replay(batch)
