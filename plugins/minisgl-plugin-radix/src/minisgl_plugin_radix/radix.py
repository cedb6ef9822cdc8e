"""A radix tree over token ids whose values are KV slot indices.

Every edge carries a run of tokens (a whole number of pages) and the KV slots
that hold them, so the path from the root to a node spells a cached prefix and
the concatenated slots are its KV. Children are keyed by their first page of
tokens, which makes lookups page-aligned for any page size: two sequences that
differ inside a page never share that page.

Locking a node (a request uses the prefix it matched) increments the reference
count of every node on its path, so a prefix in use is never evicted; eviction
removes unreferenced leaves, least recently used first, until enough tokens are
freed. Nodes are split at page boundaries when a match or an insert ends inside
an edge. The tree never frees memory itself: :meth:`RadixPrefixCache.evict`
returns slots and the KV cache manager puts their pages back on the free list.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from minisgl.kvcache import BasePrefixCache, PrefixMatch

_EMPTY = torch.empty(0, dtype=torch.int64)


class RadixNode:
    """One edge of the tree and the node it leads to.

    ``ref`` counts the locks held on this node or any node below it;
    ``own_locks`` counts only the locks whose handle is this node, so that
    ``ref == own_locks + sum(child.ref)`` is checkable.
    """

    __slots__ = ("parent", "children", "key", "slots", "ref", "own_locks", "last_access")

    def __init__(self, parent: RadixNode | None, key: list[int], slots: torch.Tensor, last_access: int):
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.key = key
        self.slots = slots
        self.ref = 0
        self.own_locks = 0
        self.last_access = last_access

    def __repr__(self) -> str:
        return f"RadixNode(len={len(self.key)}, ref={self.ref}, children={len(self.children)})"


class RadixPrefixCache(BasePrefixCache):
    """Radix-tree prefix cache with page-aligned matching and LRU eviction of unlocked leaves."""

    def __init__(self, page_size: int, device: torch.device | str = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        # Slot indices stay on the CPU whatever the device: the KV cache manager
        # keeps its bookkeeping there and copies rows to the device itself.
        self.device = torch.device(device)
        self._clock = 0  # logical time for LRU: bumped on every match and insert
        self.root = RadixNode(None, [], _EMPTY, 0)
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------ lookup
    def _page_key(self, tokens: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def _shared_len(self, key: list[int], tokens: list[int], start: int, end: int) -> int:
        """Length, in whole pages, of the common prefix of ``key`` and ``tokens[start:end]``."""
        n = min(len(key), end - start)
        n -= n % self.page_size
        if key[:n] == tokens[start : start + n]:  # the common case, compared at C speed
            return n
        i = 0
        while key[i] == tokens[start + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut ``node``'s edge after ``n`` tokens; return the new upper node.

        The lower part keeps the original object, so lock handles that point at it stay valid.
        """
        parent = node.parent
        assert parent is not None and 0 < n < len(node.key) and n % self.page_size == 0
        upper = RadixNode(parent, node.key[:n], node.slots[:n], node.last_access)
        upper.ref = node.ref  # every lock through the lower part passes through the upper part
        parent.children[self._page_key(node.key, 0)] = upper
        node.key = node.key[n:]
        node.slots = node.slots[n:]
        node.parent = upper
        upper.children[self._page_key(node.key, 0)] = node
        return upper

    def _walk(self, tokens: list[int], end: int) -> tuple[RadixNode, int, list[torch.Tensor]]:
        """Follow ``tokens[:end]`` down the tree, splitting the last edge where the match ends inside it."""
        self._clock += 1
        node, pos, pieces = self.root, 0, []
        node.last_access = self._clock
        while pos < end:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._shared_len(child.key, tokens, pos, end)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock
            pieces.append(child.slots)
            pos += n
            node = child
        return node, pos, pieces

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        tokens = list(token_ids)
        end = len(tokens) - len(tokens) % self.page_size
        node, _, pieces = self._walk(tokens, end)
        slots = torch.cat(pieces) if pieces else _EMPTY
        return PrefixMatch(handle=node, slots=slots)

    # ----------------------------------------------------------------- locking
    def lock(self, handle: Any) -> None:
        node = self._node(handle)
        node.own_locks += 1
        while node is not self.root:
            if node.ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, handle: Any) -> None:
        node = self._node(handle)
        if node.own_locks <= 0:
            raise ValueError("unlock() without a matching lock(): this prefix is not locked")
        node.own_locks -= 1
        while node is not self.root:
            node.ref -= 1
            if node.ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            assert node.parent is not None
            node = node.parent

    def _node(self, handle: Any) -> RadixNode:
        if handle is None:  # a request that never matched holds the root, which nothing can evict
            return self.root
        if not isinstance(handle, RadixNode):
            raise TypeError(f"expected a handle from RadixPrefixCache.match_prefix, got {type(handle).__name__}")
        return handle

    # ------------------------------------------------------------------ insert
    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        tokens = list(token_ids)
        if len(tokens) % self.page_size or slots.numel() != len(tokens):
            raise ValueError(
                f"insert() takes a whole number of pages with one slot per token; got {len(tokens)} tokens, "
                f"{slots.numel()} slots, page size {self.page_size}"
            )
        node, pos, _ = self._walk(tokens, len(tokens))
        if pos < len(tokens):
            leaf = RadixNode(node, tokens[pos:], slots[pos:].to("cpu", torch.int64).clone(), self._clock)
            node.children[self._page_key(tokens, pos)] = leaf
            self._evictable += len(leaf.key)
        return pos

    # ---------------------------------------------------------------- eviction
    def evict(self, num_tokens: int) -> torch.Tensor:
        if num_tokens <= 0 or self._evictable == 0:
            return _EMPTY
        order = itertools.count()  # tie-breaker: nodes themselves are not comparable
        heap = [(n.last_access, next(order), n) for n in self._nodes() if not n.children and n.ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        count = 0
        while count < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._page_key(leaf.key, 0)]
            leaf.parent = None
            freed.append(leaf.slots)
            count += len(leaf.key)
            self._evictable -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return torch.cat(freed) if freed else _EMPTY

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    # ------------------------------------------------------------- inspection
    def _nodes(self) -> Iterator[RadixNode]:
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @property
    def num_nodes(self) -> int:
        return sum(1 for _ in self._nodes())

    def all_slots(self) -> torch.Tensor:
        pieces = [n.slots for n in self._nodes()]
        return torch.cat(pieces) if pieces else _EMPTY

    def check_integrity(self) -> None:
        ps = self.page_size
        evictable = protected = 0
        offsets = torch.arange(ps, dtype=torch.int64)
        for node in [self.root, *self._nodes()]:
            assert node.own_locks >= 0, f"{node}: negative lock count"
            if node is not self.root:
                assert node.parent is not None, f"{node} is in the tree but has no parent"
                assert node.key and len(node.key) % ps == 0, f"{node}: edge of {len(node.key)} tokens, page size {ps}"
                assert node.slots.numel() == len(node.key), f"{node}: {node.slots.numel()} slots for its tokens"
                assert node.parent.children.get(self._page_key(node.key, 0)) is node, f"{node}: not under its key"
                pages = node.slots.view(-1, ps)
                assert bool((pages[:, :1] % ps == 0).all()), f"{node}: slots do not start pages"
                assert bool((pages == pages[:, :1] + offsets).all()), f"{node}: a page's slots are not contiguous"
                if node.ref:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
                below = sum(c.ref for c in node.children.values())
                assert node.ref == node.own_locks + below, (
                    f"{node}: ref {node.ref} != own locks {node.own_locks} + children {below}"
                )
        assert evictable == self._evictable, f"evictable size {self._evictable}, tree holds {evictable}"
        assert protected == self._protected, f"protected size {self._protected}, tree holds {protected}"
        slots = self.all_slots()
        assert torch.unique(slots).numel() == slots.numel(), "a KV slot is owned by two tree nodes"
