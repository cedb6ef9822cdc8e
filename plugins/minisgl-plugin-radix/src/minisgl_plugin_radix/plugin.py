"""Entry module: declares the ``radix`` prefix cache; the tree is imported only when built."""

from __future__ import annotations

from collections.abc import Iterable

from minisgl.plugins import PrefixCacheSpec, hookimpl


@hookimpl  # a plain hook ranks above the built-in 'naive' (trylast): installing this makes it the default
def minisgl_prefix_caches() -> Iterable[PrefixCacheSpec]:
    return [
        PrefixCacheSpec(
            name="radix",
            auto=True,
            factory="minisgl_plugin_radix.radix:RadixPrefixCache",
            description="radix tree over token ids: shared prompt prefixes reuse their KV, LRU eviction",
        )
    ]
