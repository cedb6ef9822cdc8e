"""The built-in paged KV pool."""

from __future__ import annotations

import torch

from ..kernel import select_kernels
from .base import BaseKVPool, KVLayout, quantize_kv


class MHAKVPool(BaseKVPool):
    """One K and one V buffer per layer, ``[num_pages, page_size, kv_heads, head_dim]``, in one allocation."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        shape = (2, layout.num_layers, layout.num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim)
        self._buffer = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
        flat = (2, layout.num_layers, layout.num_slots, layout.num_kv_heads, layout.head_dim)
        self._flat = self._buffer.view(flat)
        self.kernels = layout.kernels or select_kernels(layout.device, layout.dtype)
        # A quantized pool is written as bytes: the kernel set's store is a copy, and not every device
        # has an index_copy for float8.
        self._bytes = self._flat.view(torch.uint8) if layout.quantized else None

    def k_cache(self, layer: int) -> torch.Tensor:
        return self._buffer[0, layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._buffer[1, layer]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer: int) -> None:
        if self._bytes is None:
            self.kernels.store_kv(k, v, out_loc, self._flat[0, layer], self._flat[1, layer])
            return
        dtype, (k_scale, v_scale) = self.layout.dtype, self.layout.kv_scales(layer)
        kq, vq = quantize_kv(k, k_scale, dtype).view(torch.uint8), quantize_kv(v, v_scale, dtype).view(torch.uint8)
        self.kernels.store_kv(kq, vq, out_loc, self._bytes[0, layer], self._bytes[1, layer])
