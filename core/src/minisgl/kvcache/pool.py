"""The built-in paged KV pool."""

from __future__ import annotations

import torch

from ..kernel import select_kernels
from .base import BaseKVPool, KVLayout


class MHAKVPool(BaseKVPool):
    """One K and one V buffer per layer, ``[num_pages, page_size, kv_heads, head_dim]``, in one allocation."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        shape = (2, layout.num_layers, layout.num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim)
        self._buffer = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
        flat = (2, layout.num_layers, layout.num_slots, layout.num_kv_heads, layout.head_dim)
        self._flat = self._buffer.view(flat)
        self.kernels = layout.kernels or select_kernels(layout.device, layout.dtype)

    def k_cache(self, layer: int) -> torch.Tensor:
        return self._buffer[0, layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._buffer[1, layer]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer: int) -> None:
        k_cache, v_cache = self._flat[0, layer], self._flat[1, layer]
        if not self.layout.quantized:
            self.kernels.store_kv(k, v, out_loc, k_cache, v_cache)
            return
        k_scale, v_scale = self.layout.kv_scales(layer)
        self.kernels.store_kv_quantized(k, v, out_loc, k_cache, v_cache, k_scale, v_scale)
