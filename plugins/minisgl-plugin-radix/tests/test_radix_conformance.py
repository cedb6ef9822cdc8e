"""The radix prefix cache against the core's prefix-cache conformance kit."""

from minisgl_plugin_radix.radix import RadixPrefixCache

from minisgl.testing.prefix_cache import PrefixCacheConformance


class TestRadixConformance(PrefixCacheConformance):
    factory = RadixPrefixCache
    page_sizes = (1, 2, 4, 16)
