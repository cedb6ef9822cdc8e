"""The built-in prefix cache that caches nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .base import BasePrefixCache, PrefixMatch


class NaivePrefixCache(BasePrefixCache):
    """No reuse: every match is empty and every insert is declined."""

    reuses_prefixes = False
    evictable_size = 0
    protected_size = 0

    def __init__(self, page_size: int, device: torch.device | str = "cpu"):
        self.page_size = page_size

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        return PrefixMatch(handle=None, slots=torch.empty(0, dtype=torch.int64))

    def lock(self, handle: Any) -> None:
        pass

    def unlock(self, handle: Any) -> None:
        pass

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        return len(token_ids)

    def evict(self, num_tokens: int) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)
