"""KV cache: the paged pool, page accounting and prefix caches."""

from .base import BaseKVPool, BasePrefixCache, KVLayout, PrefixMatch
from .manager import KVCacheManager
from .naive import NaivePrefixCache
from .pool import MHAKVPool

__all__ = [
    "BaseKVPool",
    "BasePrefixCache",
    "KVCacheManager",
    "KVLayout",
    "MHAKVPool",
    "NaivePrefixCache",
    "PrefixMatch",
]
