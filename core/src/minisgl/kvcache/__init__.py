"""KV cache: the paged pool, page accounting and prefix caches."""

from .base import (
    QUANTIZED_KV_DTYPES,
    BaseKVPool,
    BasePrefixCache,
    KVLayout,
    PrefixMatch,
    dequantize_kv,
    kv_dtype_name,
    quantize_kv,
)
from .manager import KVCacheManager
from .naive import NaivePrefixCache
from .pool import MHAKVPool

__all__ = [
    "QUANTIZED_KV_DTYPES",
    "BaseKVPool",
    "BasePrefixCache",
    "KVCacheManager",
    "KVLayout",
    "MHAKVPool",
    "NaivePrefixCache",
    "PrefixMatch",
    "dequantize_kv",
    "kv_dtype_name",
    "quantize_kv",
]
