"""The core's own components, registered through the same hooks as any plugin.

This is the entry point ``builtin`` of the ``minisgl`` group (see core/pyproject.toml).
Like every entry module it names its factories lazily, so loading it imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable

from .hookspecs import hookimpl
from .specs import AttentionBackendSpec, KVPoolSpec, MoEBackendSpec, PrefixCacheSpec


@hookimpl
def minisgl_attention_backends() -> Iterable[AttentionBackendSpec]:
    """``torch``: the reference every other backend is tested against."""
    return [
        AttentionBackendSpec(
            name="torch",
            factory="minisgl.attention.torch_backend:TorchAttnBackend",
            priority=0,
            description="reference attention in plain PyTorch over the paged KV cache (CPU and CUDA)",
        )
    ]


@hookimpl
def minisgl_kv_cache_pools() -> Iterable[KVPoolSpec]:
    """``mha``: the default paged pool."""
    return [
        KVPoolSpec(
            name="mha",
            factory="minisgl.kvcache.pool:MHAKVPool",
            description="paged K/V buffers, one per layer, [pages, page_size, kv_heads, head_dim]",
        )
    ]


@hookimpl
def minisgl_prefix_caches() -> Iterable[PrefixCacheSpec]:
    """``naive``: the cache that keeps nothing (any real prefix cache outranks it under ``auto``)."""
    return [
        PrefixCacheSpec(
            name="naive",
            factory="minisgl.kvcache.naive:NaivePrefixCache",
            priority=0,
            description="no prefix reuse: every request computes its whole prompt",
        )
    ]


@hookimpl
def minisgl_moe_backends() -> Iterable[MoEBackendSpec]:
    """``torch``: the reference mixture-of-experts computation."""
    return [
        MoEBackendSpec(
            name="torch",
            factory="minisgl.moe.torch_backend:TorchMoEBackend",
            priority=0,
            description="reference mixture-of-experts: sorted tokens, one matmul pair per expert",
        )
    ]
