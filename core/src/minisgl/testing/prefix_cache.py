"""Conformance kit for prefix caches (:class:`minisgl.kvcache.BasePrefixCache`).

A plugin's tests subclass :class:`PrefixCacheConformance` and name a factory::

    from minisgl.testing.prefix_cache import PrefixCacheConformance
    from my_plugin.cache import MyPrefixCache

    class TestMyCacheConformance(PrefixCacheConformance):
        factory = MyPrefixCache          # called as factory(page_size=..., device="cpu")

The inherited tests drive the cache with random operation sequences
(hypothesis) and compare it with :class:`ReferencePrefixCache`, a plain
dictionary of cached pages:

* ``match_prefix`` returns exactly the reference's longest cached page-aligned
  prefix, with the slots that were inserted for it;
* ``insert`` returns the length the cache already held (or the whole length,
  for a cache that keeps nothing);
* ``evict`` frees whole, unlocked pages (at least as many tokens as asked when
  that many are evictable), leaves the cache prefix-closed and never touches a
  locked prefix; ``evictable_size``/``protected_size`` match the reference;
* ``check_integrity`` passes after every operation and no slot is ever owned
  twice (by the cache and the test's free list);
* through :class:`~minisgl.kvcache.KVCacheManager`, random admissions, prefill
  chunks, decode steps and releases keep page accounting exact
  (``check_accounting``), and every slot a request reads holds the KV of
  exactly the token prefix it expects.

Set ``stores_prefixes = False`` for a cache that never keeps anything (like
the built-in ``naive``); the kit then checks that it declines every insert.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..core import Req, SamplingParams
from ..kvcache import BasePrefixCache, KVCacheManager
from ..plugins import resolve

Prefix = tuple[int, ...]


class ReferencePrefixCache:
    """The obvious model of a prefix cache: every cached page-aligned prefix maps to its last page's slots."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.pages: dict[Prefix, list[int]] = {}  # prefix (whole pages) -> slots of its last page
        self.locks: list[Prefix] = []  # one entry per outstanding lock: the prefix it protects

    def present_len(self, tokens: Sequence[int]) -> int:
        ps, n = self.page_size, 0
        while n + ps <= len(tokens) and tuple(tokens[: n + ps]) in self.pages:
            n += ps
        return n

    def match(self, tokens: Sequence[int]) -> list[int]:
        n = self.present_len(tokens)
        return [s for k in range(self.page_size, n + 1, self.page_size) for s in self.pages[tuple(tokens[:k])]]

    def add(self, tokens: Sequence[int], slots: list[int], start: int) -> None:
        """The cache took ``slots[start:]`` for ``tokens[start:]``."""
        ps = self.page_size
        for k in range(start, len(tokens), ps):
            self.pages[tuple(tokens[: k + ps])] = slots[k : k + ps]

    def protected(self) -> set[Prefix]:
        ps = self.page_size
        return {p[:k] for p in self.locks for k in range(ps, len(p) + 1, ps)}

    def sizes(self) -> tuple[int, int]:
        """(evictable, protected) in tokens."""
        protected = len(self.protected()) * self.page_size
        return len(self.pages) * self.page_size - protected, protected

    def all_slots(self) -> set[int]:
        return {s for slots in self.pages.values() for s in slots}

    def remove_freed(self, freed: list[int]) -> None:
        """Drop the pages whose slots a cache gave back, checking that it was allowed to."""
        ps = self.page_size
        assert len(freed) % ps == 0, f"evict returned {len(freed)} slots, not whole pages of {ps}"
        by_first = {slots[0]: prefix for prefix, slots in self.pages.items()}
        protected = self.protected()
        for i in range(0, len(freed), ps):
            prefix = by_first.get(freed[i])
            assert prefix is not None, f"evict returned slot {freed[i]}, which the cache did not hold"
            assert freed[i : i + ps] == self.pages[prefix], f"evict returned a partial page at slot {freed[i]}"
            assert prefix not in protected, f"evict freed a locked prefix of {len(prefix)} tokens"
            del self.pages[prefix]
        for prefix in self.pages:
            parent = prefix[:-ps]
            assert not parent or parent in self.pages, "evict left a cached prefix whose parent page is gone"


class _SlotPool:
    """Pages for the test to hand to the cache; each page is free here or held by the cache, never both."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.num_pages = num_pages
        self.free = list(range(num_pages - 1, -1, -1))

    def take(self, num_tokens: int) -> list[int] | None:
        ps = self.page_size
        n = num_tokens // ps
        if n > len(self.free):
            return None
        pages = [self.free.pop() for _ in range(n)]
        return [p * ps + o for p in pages for o in range(ps)]

    def give_back(self, slots: Sequence[int]) -> None:
        self.free.extend(int(s) // self.page_size for s in slots[:: self.page_size])

    def check(self, cached: set[int]) -> None:
        free = set(self.free)
        assert len(free) == len(self.free), "a page is on the test's free list twice"
        cached_pages = {s // self.page_size for s in cached}
        assert not free & cached_pages, f"pages {sorted(free & cached_pages)[:5]} are free and cached at once"
        assert len(free) + len(cached_pages) == self.num_pages, "pages leaked between the test and the cache"


def _sequences(page_size: int) -> st.SearchStrategy[list[int]]:
    """Token sequences made of a few pages that differ only in their last token, to force sharing and splits."""
    pages = [[0] * (page_size - 1) + [j] for j in range(3)]
    return st.lists(st.sampled_from(range(3)), max_size=6).map(lambda idx: [t for i in idx for t in pages[i]])


# Subclasses inherit these tests, so hypothesis sees one function run through several classes; that is
# intended here (each run builds its own cache), hence differing_executors is not a problem.
_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors]
)


class PrefixCacheConformance:
    """Base test class: subclass it in a plugin's tests and set :attr:`factory`."""

    #: The cache class or factory (or a lazy "pkg.mod:attr" string), called as factory(page_size=, device=).
    factory: ClassVar[Callable[..., BasePrefixCache] | str | None] = None
    #: Page sizes to test with.
    page_sizes: ClassVar[tuple[int, ...]] = (1, 2, 4)
    #: False for a cache that keeps nothing (every insert declined, every match empty).
    stores_prefixes: ClassVar[bool] = True

    def make_cache(self, page_size: int) -> BasePrefixCache:
        factory = type(self).factory
        if factory is None:
            raise TypeError(f"{type(self).__name__} must set `factory` to the prefix cache class under test")
        cache = resolve(factory)(page_size=page_size, device=torch.device("cpu"))
        assert isinstance(cache, BasePrefixCache), f"factory returned {type(cache).__name__}, not a BasePrefixCache"
        assert cache.page_size == page_size
        return cache

    # ------------------------------------------------------------ examples
    def test_empty_cache(self) -> None:
        for ps in self.page_sizes:
            cache = self.make_cache(ps)
            match = cache.match_prefix(list(range(3 * ps)))
            assert match.length == 0 and match.slots.dtype == torch.int64
            cache.lock(match.handle)
            cache.unlock(match.handle)
            assert (cache.evictable_size, cache.protected_size) == (0, 0)
            assert cache.evict(ps).numel() == 0
            cache.check_integrity()

    def test_match_is_page_aligned(self) -> None:
        for ps in self.page_sizes:
            cache = self.make_cache(ps)
            tokens = list(range(100, 100 + 3 * ps))
            slots = torch.arange(8 * ps, 11 * ps, dtype=torch.int64)
            kept_from = cache.insert(tokens, slots)
            if not self.stores_prefixes:
                assert kept_from == len(tokens), "a cache that stores nothing must decline the whole insert"
                continue
            assert kept_from == 0
            # A query that leaves the cached path inside its third page matches two pages only.
            query = tokens[: 3 * ps - 1] + [7]
            match = cache.match_prefix(query)
            assert match.length == 2 * ps
            assert match.slots.tolist() == slots[: 2 * ps].tolist()
            # A query with a partial trailing page matches only whole pages.
            assert cache.match_prefix(tokens + [1]).length == 3 * ps
            assert cache.match_prefix(tokens[: 2 * ps + ps // 2]).length == 2 * ps
            # Inserting the same tokens again keeps nothing.
            assert cache.insert(tokens, torch.arange(20 * ps, 23 * ps, dtype=torch.int64)) == len(tokens)
            cache.check_integrity()

    def test_locked_prefix_survives_eviction(self) -> None:
        if not self.stores_prefixes:
            return
        for ps in self.page_sizes:
            cache = self.make_cache(ps)
            a, b = [1] * (2 * ps), [2] * (2 * ps)
            cache.insert(a, torch.arange(0, 2 * ps, dtype=torch.int64))
            cache.insert(b, torch.arange(2 * ps, 4 * ps, dtype=torch.int64))
            match = cache.match_prefix(a)
            cache.lock(match.handle)
            assert (cache.evictable_size, cache.protected_size) == (2 * ps, 2 * ps)
            freed = cache.evict(100 * ps)
            assert sorted(freed.tolist()) == list(range(2 * ps, 4 * ps))
            assert cache.match_prefix(a).length == 2 * ps and cache.match_prefix(b).length == 0
            cache.unlock(match.handle)
            assert (cache.evictable_size, cache.protected_size) == (2 * ps, 0)
            assert sorted(cache.reset().tolist()) == list(range(0, 2 * ps))
            cache.check_integrity()

    # ------------------------------------------------------- random sequences
    @_SETTINGS
    @given(data=st.data())
    def test_random_operations_match_reference(self, data: st.DataObject) -> None:
        ps = data.draw(st.sampled_from(self.page_sizes), label="page_size")
        cache = self.make_cache(ps)
        ref = ReferencePrefixCache(ps)
        pool = _SlotPool(256, ps)
        handles: list[Any] = []
        seqs = _sequences(ps)
        for _ in range(data.draw(st.integers(1, 40), label="num_ops")):
            op = data.draw(st.sampled_from(["match", "insert", "insert_fresh", "lock", "unlock", "evict", "reset"]))
            if op == "match":
                tokens = data.draw(seqs) + data.draw(st.lists(st.integers(0, 2), max_size=ps - 1))
                self._check_match(cache, ref, tokens)
            elif op in ("insert", "insert_fresh"):
                tokens = data.draw(seqs)
                # "insert" reuses the cache's slots for the part it holds, as a request that matched
                # does; "insert_fresh" offers all-new slots, as two requests that computed the same
                # prompt at once do.
                matched = self._check_match(cache, ref, tokens) if op == "insert" else []
                fresh = pool.take(len(tokens) - len(matched))
                if fresh is None:
                    continue
                slots = matched + fresh
                present = ref.present_len(tokens)
                kept_from = cache.insert(tokens, torch.tensor(slots, dtype=torch.int64))
                if self.stores_prefixes:
                    assert kept_from == present, f"insert returned {kept_from}; the cache held {present} tokens"
                else:
                    assert kept_from == len(tokens), f"insert returned {kept_from}, expected {len(tokens)}"
                ref.add(tokens, slots, kept_from)
                pool.give_back(slots[len(matched) : kept_from])  # duplicates the cache did not take
            elif op == "lock":
                tokens = data.draw(seqs)
                match = cache.match_prefix(tokens)
                cache.lock(match.handle)
                handles.append(match.handle)
                ref.locks.append(tuple(tokens[: match.length]))
            elif op == "unlock" and handles:
                i = data.draw(st.integers(0, len(handles) - 1))
                cache.unlock(handles.pop(i))
                ref.locks.pop(i)
            elif op == "evict":
                self._check_evict(cache, ref, pool, data.draw(st.integers(0, 8)) * ps)
            elif op == "reset":
                self._check_evict(cache, ref, pool, None)
            self._check_state(cache, ref, pool)
        while handles:
            cache.unlock(handles.pop())
            ref.locks.pop()
        self._check_evict(cache, ref, pool, None)
        self._check_state(cache, ref, pool)
        assert (cache.evictable_size, cache.protected_size) == (0, 0), "reset with no locks must empty the cache"

    def _check_match(self, cache: BasePrefixCache, ref: ReferencePrefixCache, tokens: list[int]) -> list[int]:
        match = cache.match_prefix(tokens)
        expected = ref.match(tokens)
        assert match.length % ref.page_size == 0, f"match of {match.length} tokens is not page-aligned"
        assert match.slots.tolist() == expected, (
            f"match_prefix returned {match.length} tokens ({match.slots.tolist()}); the reference holds "
            f"{len(expected)} ({expected})"
        )
        return expected

    def _check_evict(
        self, cache: BasePrefixCache, ref: ReferencePrefixCache, pool: _SlotPool, num_tokens: int | None
    ) -> None:
        before = cache.evictable_size
        freed_t = cache.reset() if num_tokens is None else cache.evict(num_tokens)
        freed = freed_t.tolist()
        want = before if num_tokens is None else min(num_tokens, before)
        assert len(freed) >= want, f"evict({num_tokens}) freed {len(freed)} tokens with {before} evictable"
        assert cache.evictable_size == before - len(freed), "evictable_size did not drop by what was freed"
        ref.remove_freed(freed)
        pool.give_back(freed)

    def _check_state(self, cache: BasePrefixCache, ref: ReferencePrefixCache, pool: _SlotPool) -> None:
        cache.check_integrity()
        assert (cache.evictable_size, cache.protected_size) == ref.sizes(), (
            f"(evictable, protected) = {(cache.evictable_size, cache.protected_size)}, reference {ref.sizes()}"
        )
        cached = ref.all_slots()
        if self.stores_prefixes:
            owned = cache.all_slots().tolist()
            assert len(owned) == len(set(owned)) and set(owned) == cached, "all_slots() differs from the reference"
        pool.check(cached)

    # ------------------------------------------------ through the KV manager
    @_SETTINGS
    @given(data=st.data())
    def test_manager_accounting_is_exact(self, data: st.DataObject) -> None:
        ps = data.draw(st.sampled_from(self.page_sizes), label="page_size")
        num_pages = data.draw(st.integers(4, 24), label="num_pages")
        kv = KVCacheManager(num_pages, ps, max_reqs=3, max_seq_len=16 * ps, cache=self.make_cache(ps))
        contents: dict[int, Prefix] = {}  # slot -> the token prefix whose last token's KV it holds
        live: list[Req] = []
        waiting: list[Req] = []
        history: list[list[int]] = []  # finished sequences, to extend as the next turn of a conversation
        seqs = _sequences(ps)
        params = SamplingParams(temperature=0.0)
        for rid in range(data.draw(st.integers(1, 40), label="num_ops")):
            op = data.draw(st.sampled_from(["add", "step", "step", "step", "finish", "admit", "reset_cache"]))
            if op == "add":
                turn: bool = data.draw(st.booleans(), label="continue a conversation")
                base: list[int] = data.draw(st.sampled_from(history)) if turn and history else []
                prompt = base + data.draw(seqs) + data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=ps + 1))
                req = Req(rid, prompt, params, max_new_tokens=data.draw(st.integers(1, 2 * ps)))
                if kv.fits_ever(req):
                    waiting.append(req)
            if op in ("add", "admit") and waiting and kv.try_admit(waiting[0]):
                req = waiting.pop(0)
                assert req.prefix_len % ps == 0 and req.prefix_len < req.prompt_len
                live.append(req)
            elif op == "step" and live:
                req = data.draw(st.sampled_from(live))
                if req.cached_len < req.prompt_len:
                    upto = min(req.prompt_len, req.cached_len + data.draw(st.integers(1, 3 * ps)))
                else:
                    upto = req.total_len
                kv.allocate(req, upto)
                new_slots = kv.table[req.table_idx, req.cached_len : upto].tolist()
                for slot, pos in zip(new_slots, range(req.cached_len, upto), strict=True):
                    contents[slot] = tuple(req.all_ids[: pos + 1])
                req.cached_len = upto
                if upto == req.total_len:  # end of the prompt or a decode step: a token is sampled
                    req.output_ids.append(data.draw(st.integers(0, 2)))
                if len(req.output_ids) >= req.max_new_tokens:
                    live.remove(req)
                    kv.release(req)
                    history.append(req.all_ids[: req.cached_len])
            elif op == "finish" and live:  # abort, or a stop token
                req = data.draw(st.sampled_from(live))
                live.remove(req)
                kv.release(req)
            elif op == "reset_cache":  # evict everything unlocked: what a request uses must survive
                kv.reset_cache()
            kv.check_accounting(live)
            free = {p * ps + o for p in kv.free_page_ids() for o in range(ps)}
            for req in live:  # every slot a request will read holds the KV of exactly its prefix
                row = kv.table[req.table_idx, : req.cached_len].tolist()
                assert not free & set(row), f"request {req.rid} reads free slots {sorted(free & set(row))[:4]}"
                for pos, slot in enumerate(row):
                    assert contents.get(slot) == tuple(req.all_ids[: pos + 1]), (
                        f"request {req.rid} reads slot {slot} for position {pos}, which holds other KV"
                    )
        for req in live:
            kv.release(req)
        kv.check_accounting([])
        kv.reset_cache()
        assert kv.free_pages == kv.usable_pages, f"{kv.usable_pages - kv.free_pages} pages not returned"
