"""Radix-specific behaviour the generic conformance kit does not pin down: LRU order, splits, errors."""

from __future__ import annotations

import pytest
import torch
from minisgl_plugin_radix.radix import RadixPrefixCache


def _slots(start_page: int, num_pages: int, page_size: int) -> torch.Tensor:
    return torch.arange(start_page * page_size, (start_page + num_pages) * page_size, dtype=torch.int64)


def test_eviction_is_least_recently_used_first() -> None:
    cache = RadixPrefixCache(page_size=2)
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    cache.insert(a, _slots(0, 2, 2))
    cache.insert(b, _slots(2, 2, 2))
    cache.insert(c, _slots(4, 2, 2))
    cache.match_prefix(a)  # a is now the most recently used; b the least
    assert sorted(cache.evict(1).tolist()) == _slots(2, 2, 2).tolist()  # a whole leaf goes, even for 1 token
    assert sorted(cache.evict(4).tolist()) == _slots(4, 2, 2).tolist()
    assert cache.match_prefix(a).length == 4
    cache.check_integrity()


def test_evicting_a_leaf_exposes_its_parent() -> None:
    cache = RadixPrefixCache(page_size=1)
    cache.insert([5, 6, 7], _slots(0, 3, 1))
    cache.insert([5, 6, 8], torch.tensor([0, 1, 9]))  # shares [5, 6]: keeps only slot 9
    assert cache.num_nodes == 3  # [5, 6] split off, with leaves [7] and [8]
    freed = cache.evict(3)
    assert sorted(freed.tolist()) == [0, 1, 2, 9]
    assert cache.num_nodes == 0 and cache.evictable_size == 0
    cache.check_integrity()


def test_split_keeps_lock_handles_valid() -> None:
    ps = 4
    cache = RadixPrefixCache(page_size=ps)
    tokens = list(range(3 * ps))
    cache.insert(tokens, _slots(0, 3, ps))
    whole = cache.match_prefix(tokens)
    cache.lock(whole.handle)
    # A match that ends inside the locked edge splits it; the upper part inherits the lock.
    part = cache.match_prefix(tokens[:ps] + [99] * ps)
    assert part.length == ps and cache.num_nodes == 2
    cache.check_integrity()
    assert (cache.evictable_size, cache.protected_size) == (0, 3 * ps)
    cache.unlock(whole.handle)
    assert (cache.evictable_size, cache.protected_size) == (3 * ps, 0)
    cache.check_integrity()


def test_divergence_inside_a_page_shares_nothing_of_that_page() -> None:
    cache = RadixPrefixCache(page_size=4)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], _slots(0, 2, 4))
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 9], _slots(5, 2, 4)) == 4  # keeps only its second page
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 9]).slots.tolist() == [0, 1, 2, 3, 24, 25, 26, 27]
    cache.check_integrity()


def test_misuse_is_reported_clearly() -> None:
    cache = RadixPrefixCache(page_size=4)
    with pytest.raises(ValueError, match="whole number of pages with one slot per token; got 3 tokens, 3 slots"):
        cache.insert([1, 2, 3], torch.arange(3))
    cache.insert([1, 2, 3, 4], torch.arange(4))
    match = cache.match_prefix([1, 2, 3, 4])
    with pytest.raises(ValueError, match="unlock\\(\\) without a matching lock\\(\\)"):
        cache.unlock(match.handle)
    with pytest.raises(TypeError, match="expected a handle from RadixPrefixCache.match_prefix, got str"):
        cache.lock("not a handle")
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        RadixPrefixCache(page_size=0)


def test_integrity_check_catches_corruption() -> None:
    cache = RadixPrefixCache(page_size=2)
    cache.insert([1, 1, 2, 2], _slots(0, 2, 2))
    cache.insert([1, 1, 3, 3], torch.tensor([0, 1, 2, 3]))  # a slot already owned by the [2, 2] page
    with pytest.raises(AssertionError, match="owned by two tree nodes"):
        cache.check_integrity()

    cache = RadixPrefixCache(page_size=2)
    cache.insert([1, 1], _slots(0, 1, 2))
    node = cache.match_prefix([1, 1]).handle
    node.ref = 1  # a reference count that no lock explains
    with pytest.raises(AssertionError, match="ref 1 != own locks 0"):
        cache.check_integrity()
