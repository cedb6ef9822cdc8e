"""The built-in "naive" prefix cache against the prefix-cache conformance kit."""

from minisgl.kvcache import NaivePrefixCache
from minisgl.testing.prefix_cache import PrefixCacheConformance


class TestNaiveConformance(PrefixCacheConformance):
    factory = NaivePrefixCache
    stores_prefixes = False
