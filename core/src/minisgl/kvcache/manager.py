"""Page accounting: the free list, the host request-to-slot table and the prefix cache.

Every usable page is free, owned by the prefix cache, or owned by one live request; page 0 is scratch (padded
entries write there). Admission reserves what a request needs now plus the growth the scheduler estimates for it
(:meth:`KVCacheManager.try_admit`); past its reservation a request takes spare pages (:attr:`spare_pages`), and when
there are none the scheduler preempts one. Running requests offer their computed prompt pages to the cache, so a
burst with a shared system prompt computes it once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core import Req
from .base import BasePrefixCache


@dataclass
class _RowState:
    req: Req
    alloc_len: int = 0  # slots written into the table row (a multiple of page_size)
    reserved_pages: int = 0  # pages this request may still take from the free list
    shared_len: int = 0  # row slots [0, shared_len) belong to the cache, locked by req.cache_handle
    offered_len: int = 0  # prompt tokens last offered to the cache while running
    taken_len: int = 0  # row slots [0, taken_len) were handed out by take_new_entries


class KVCacheManager:
    """Allocates KV slots to requests and hands finished prefixes to the prefix cache."""

    def __init__(self, num_pages: int, page_size: int, max_reqs: int, max_seq_len: int, cache: BasePrefixCache):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_seq_len = self.pages_for(max_seq_len) * page_size
        self.cache = cache
        self.table = torch.zeros((max_reqs, self.max_seq_len), dtype=torch.int32)  # row -> token slots
        self._free_rows = list(range(max_reqs - 1, -1, -1))
        self._free_pages: list[int] = list(range(num_pages - 1, 0, -1))
        self._rows: dict[int, _RowState] = {}
        self._reserved_total = 0

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def free_page_ids(self) -> list[int]:
        """The free list itself (a copy), for accounting checks."""
        return list(self._free_pages)

    @property
    def reserved_pages(self) -> int:
        """Pages set aside for admitted requests' growth (not yet taken from the free list)."""
        return self._reserved_total

    @property
    def spare_pages(self) -> int:
        """Pages free or evictable and not reserved: what a request may take past its reservation."""
        return self.free_pages + self.cache.evictable_size // self.page_size - self._reserved_total

    def growth_pages(self, req: Req, upto: int) -> int:
        """Pages beyond its reservation ``req`` needs for positions ``[0, upto)`` (taken from the spare ones)."""
        state = self._rows[req.table_idx]
        new_pages = self.pages_for(upto) - state.alloc_len // self.page_size
        return max(0, new_pages - state.reserved_pages)

    @property
    def cache_pages(self) -> int:
        return self.cache.total_size() // self.page_size

    @property
    def used_pages(self) -> int:
        """Pages not on the free list (owned by requests or the prefix cache)."""
        return self.usable_pages - self.free_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def fits_ever(self, req: Req) -> bool:
        """Whether ``req`` could run on an otherwise empty pool."""
        return self.pages_for(req.max_total_len) <= self.usable_pages and req.max_total_len <= self.max_seq_len

    def cached_prefix_len(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` the prefix cache could serve now (page-aligned)."""
        self._share_prefixes()
        return self.cache.match_prefix(token_ids).length

    def try_admit(self, req: Req, reserve_len: int | None = None) -> bool:
        """Match the prefill's cached prefix, lock it and reserve pages for positions ``[0, reserve_len)`` beyond
        it (default: the worst case, ``max_total_len``); False if that does not fit now."""
        if not self._free_rows:
            return False
        self._share_prefixes()
        # Always compute at least the last prefill token: its logits start decoding.
        match = self.cache.match_prefix(req.fill_ids(0, req.fill_len - 1))
        self.cache.lock(match.handle)
        upto = req.max_total_len if reserve_len is None else max(reserve_len, req.fill_len)
        need = self.pages_for(upto) - match.length // self.page_size
        # A request may reserve pages that are free or evictable and not reserved by another.
        if need > self.free_pages + self.cache.evictable_size // self.page_size - self._reserved_total:
            self.cache.unlock(match.handle)
            return False
        row = self._free_rows.pop()
        if match.length:
            self.table[row, : match.length] = match.slots.to(torch.int32)
        self._rows[row] = _RowState(
            req, alloc_len=match.length, reserved_pages=need, shared_len=match.length, offered_len=match.length
        )
        self._reserved_total += need
        req.table_idx = row
        req.cache_handle = match.handle
        req.prefix_len = match.length
        req.cached_len = match.length
        return True

    def _share_prefixes(self) -> None:
        """Offer each running request's computed page-aligned prompt prefix to the cache; if taken, the lock
        moves to it, as if matched at admission. A prompt the cache already holds in other pages (computed
        twice at once) stays the request's own: the device table already has its slots."""
        for row, state in self._rows.items():
            req = state.req
            end = min(req.cached_len, req.fill_len)
            end -= end % self.page_size
            if end <= state.offered_len:
                continue
            state.offered_len = end
            tokens = req.fill_ids(0, end)
            if self.cache.match_prefix(tokens).length != state.shared_len:
                continue
            kept_from = self.cache.insert(tokens, self.table[row, :end].to(torch.int64))
            if kept_from >= end:
                continue  # the cache keeps nothing (e.g. "naive"): the request keeps owning its pages
            match = self.cache.match_prefix(tokens)
            if kept_from != state.shared_len or match.length != end:
                raise RuntimeError(
                    f"prefix cache {type(self.cache).__name__} broke its contract: it held {state.shared_len} "
                    f"tokens of a {end}-token insert, which returned {kept_from}, and then matched {match.length}"
                )
            self.cache.lock(match.handle)
            self.cache.unlock(req.cache_handle)
            req.cache_handle = match.handle
            state.shared_len = end

    def allocate(self, req: Req, upto: int) -> None:
        """Make sure ``req``'s table row has slots for positions ``[0, upto)``."""
        state = self._rows[req.table_idx]
        if upto > state.alloc_len:
            new_pages = self.pages_for(upto) - state.alloc_len // self.page_size
            pages = self._take_pages(new_pages)
            from_reserve = min(new_pages, state.reserved_pages)  # the rest were spare pages
            state.reserved_pages -= from_reserve
            self._reserved_total -= from_reserve
            offsets = torch.arange(self.page_size, dtype=torch.int32)
            slots = (pages.view(-1, 1) * self.page_size + offsets).view(-1)
            end = state.alloc_len + slots.numel()
            self.table[req.table_idx, state.alloc_len : end] = slots
            state.alloc_len = end

    def take_new_entries(self, reqs: Sequence[Req]) -> torch.Tensor | None:
        """The table entries of ``reqs`` not handed out before, as int64 ``[3, n]`` rows (row, column,
        slot), or None if there are none: what a copy of the table elsewhere lacks."""
        spans = []
        for req in reqs:
            state = self._rows[req.table_idx]
            if state.alloc_len > state.taken_len:
                spans.append((req.table_idx, state.taken_len, state.alloc_len))
                state.taken_len = state.alloc_len
        if not spans:
            return None
        # Three concatenations and one stack per step, not a stack per request: with page size 1 every running
        # request has a new entry at every decode step (256 of them: 1.0 ms on the host instead of 1.6 ms).
        rows = torch.cat([torch.full((e - s,), r, dtype=torch.int64) for r, s, e in spans])
        cols = torch.cat([torch.arange(s, e, dtype=torch.int64) for _, s, e in spans])
        slots = torch.cat([self.table[r, s:e] for r, s, e in spans]).to(torch.int64)
        return torch.stack([rows, cols, slots])

    def _take_pages(self, n: int) -> torch.Tensor:
        if n > len(self._free_pages):
            freed = self.cache.evict((n - len(self._free_pages)) * self.page_size)
            self._return_slots(freed)
        if n > len(self._free_pages):
            raise RuntimeError(  # admission reserves pages and the scheduler preempts: this is a bug
                f"KV pool exhausted: need {n} pages, {len(self._free_pages)} free after eviction"
            )
        taken = self._free_pages[len(self._free_pages) - n :]
        del self._free_pages[len(self._free_pages) - n :]
        return torch.tensor(taken, dtype=torch.int32)

    def _return_slots(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free_pages.extend((slots[:: self.page_size] // self.page_size).tolist())

    def release(self, req: Req) -> None:
        """Return ``req``'s row and pages; its computed prefix goes to the prefix cache."""
        if req.table_idx < 0:
            return
        row = req.table_idx
        state = self._rows.pop(row)
        slots = self.table[row, : state.alloc_len].to(torch.int64)
        shared = state.shared_len
        aligned = (req.cached_len // self.page_size) * self.page_size
        kept_from = aligned
        if aligned > shared:
            # Tokens [0, aligned) have valid KV; the cache keeps slots[n:aligned], and
            # slots[shared:n] duplicate tokens it already held.
            kept_from = max(self.cache.insert(req.all_ids[:aligned], slots[:aligned]), shared)
        self._return_slots(slots[shared:kept_from])
        self._return_slots(slots[max(aligned, shared) : state.alloc_len])
        self.cache.unlock(req.cache_handle)
        self._reserved_total -= state.reserved_pages
        self._free_rows.append(row)
        req.table_idx = -1
        req.cache_handle = None

    def reset_cache(self) -> None:
        """Evict everything unlocked from the prefix cache."""
        self._return_slots(self.cache.reset())

    def check_accounting(self, live: list[Req]) -> None:
        """Assert that every usable page is free, cached, or owned by one live request."""
        owner: dict[int, str] = {}

        def claim(pages: list[int], who: str) -> None:
            for p in pages:
                assert 0 < p < self.num_pages, f"page {p} out of range (owner {who})"
                assert p not in owner, f"page {p} owned by both {owner[p]} and {who}"
                owner[p] = who

        claim(list(self._free_pages), "free list")
        claim(sorted({int(s) // self.page_size for s in self.cache.all_slots().tolist()}), "prefix cache")
        for req in live:
            if req.table_idx < 0:
                continue
            state = self._rows[req.table_idx]
            pages = self.table[req.table_idx, state.shared_len : state.alloc_len : self.page_size] // self.page_size
            claim(pages.tolist(), f"request {req.rid}")
        self.cache.check_integrity()
        reserved = sum(s.reserved_pages for s in self._rows.values())
        assert reserved == self._reserved_total, f"{self._reserved_total} pages reserved, rows hold {reserved}"
        assert self.spare_pages >= 0, f"{self._reserved_total} pages reserved but only {self.spare_pages} spare"
        assert len(owner) == self.usable_pages, (
            f"{self.usable_pages - len(owner)} pages leaked: {len(self._free_pages)} free, "
            f"{len(owner) - len(self._free_pages)} owned, {self.usable_pages} usable"
        )
        assert len(self._rows) == sum(1 for r in live if r.table_idx >= 0), "table rows leaked"
