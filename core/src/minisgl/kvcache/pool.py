"""The built-in paged KV pool."""

from __future__ import annotations

import torch

from .base import BaseKVPool, KVLayout


class MHAKVPool(BaseKVPool):
    """One K and one V buffer per layer, ``[num_pages, page_size, kv_heads, head_dim]``.

    Both live in a single allocation so the pool is one tensor to size and free.
    """

    def __init__(self, layout: KVLayout):
        self.layout = layout
        shape = (2, layout.num_layers, layout.num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim)
        self._buffer = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
        flat = (2, layout.num_layers, layout.num_slots, layout.num_kv_heads, layout.head_dim)
        self._flat = self._buffer.view(flat)
        from .. import kernel  # lazy: keeps Triton out of CPU imports

        self._store = kernel.store_kv_kernel() if kernel.enabled(layout.device) else None
        self._cpu = kernel.cpu_kernels(layout.device, layout.dtype)

    def k_cache(self, layer: int) -> torch.Tensor:
        return self._buffer[0, layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._buffer[1, layer]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer: int) -> None:
        dtype = self.layout.dtype
        if self._store is not None and k.dtype == dtype and v.dtype == dtype:
            self._store(k, v, out_loc, self._flat[0, layer], self._flat[1, layer])
            return
        if self._cpu is not None and k.dtype == v.dtype == dtype and out_loc.dtype == torch.int64:
            width = k.shape[-2] * k.shape[-1]
            k2, v2 = k.reshape(-1, width), v.reshape(-1, width)  # views for the layouts the layers give
            self._cpu.store_kv(k2, v2, out_loc.contiguous(), self._flat[0, layer], self._flat[1, layer])
            return
        self._flat[0, layer].index_copy_(0, out_loc, k.to(dtype))
        self._flat[1, layer].index_copy_(0, out_loc, v.to(dtype))
