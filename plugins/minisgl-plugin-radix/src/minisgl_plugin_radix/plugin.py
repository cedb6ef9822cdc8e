"""Entry module: declares the ``radix`` prefix cache; the tree is imported only when built."""

from __future__ import annotations

from collections.abc import Iterable

from minisgl.plugins import PrefixCacheSpec, hookimpl


@hookimpl
def minisgl_prefix_caches() -> Iterable[PrefixCacheSpec]:
    return [
        PrefixCacheSpec(
            name="radix",
            factory="minisgl_plugin_radix.radix:RadixPrefixCache",
            # Above the built-in "naive" (0), so installing this plugin makes it the default.
            priority=10,
            description="radix tree over token ids: shared prompt prefixes reuse their KV, LRU eviction",
        )
    ]
