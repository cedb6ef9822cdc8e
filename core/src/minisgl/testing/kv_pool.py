"""Conformance kit for KV cache pools.

Subclass :class:`KVPoolConformance` in a test module, with a name starting with
``Test``, and say which pool to test; pytest collects the inherited tests::

    from minisgl.testing.kv_pool import KVPoolConformance

    class TestMyPool(KVPoolConformance):
        pool = "mypool"              # a registry name, a KVPoolSpec, "pkg.mod:Class" or a factory
        device = "cuda"
        dtype = torch.bfloat16

The tests check what every attention backend relies on: ``k_cache``/``v_cache``
shapes, dtype and device, and that ``store_kv`` writes exactly the given slots
of exactly the given layer, at arbitrary (scattered, cross-page) slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from ..kvcache import BaseKVPool, KVLayout
from ..plugins import ComponentSpec, Kind, PluginRegistry, load_plugins, resolve

ComponentRef = str | ComponentSpec | Callable[..., Any]


def build_component(
    ref: ComponentRef, kind: Kind, device: str, registry: Callable[[], PluginRegistry], *args: Any, **kwargs: Any
) -> Any:
    """Build a component named by ``ref``: a registry name, a spec, a lazy ``"pkg.mod:attr"`` or a factory.

    A spec (or a registry name) that does not support ``device`` skips the test.
    """
    if isinstance(ref, str) and ":" not in ref:
        ref = registry().get(kind, ref)
    if isinstance(ref, ComponentSpec):
        if not ref.supports(device):
            pytest.skip(f"{ref.label} does not support device '{device}'")
        return ref.build(*args, **kwargs)
    return resolve(ref)(*args, **kwargs)


def skip_without_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` that a correct kernel meets against the reference, by dtype."""
    if dtype == torch.float32:
        return 2e-4, 2e-4
    if dtype == torch.float16:
        return 1e-2, 1e-2
    return 3e-2, 3e-2  # bfloat16 and 8-bit formats


@dataclass(frozen=True)
class PoolCase:
    """One pool shape under test."""

    page_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def id(self) -> str:
        return f"ps{self.page_size}-kv{self.num_kv_heads}-d{self.head_dim}"


POOL_CASES = tuple(PoolCase(ps, h, d) for ps in (1, 16) for h in (1, 2, 8) for d in (64, 128))


class KVPoolConformance:
    """Base class of a KV pool's conformance tests. Set ``pool``; the rest has defaults.

    ``atol``/``rtol`` loosen the round-trip comparison for pools that store in a
    lossy format (the default demands the exact values, cast to the pool dtype).
    """

    pool: ComponentRef = "mha"
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    num_layers: int = 3
    num_pages: int = 9
    page_sizes: tuple[int, ...] = (1, 16)
    atol: float = 0.0
    rtol: float = 0.0
    seed: int = 0

    def load_registry(self) -> PluginRegistry:
        """The registry a plain ``pool`` name is looked up in (override to pin plugins)."""
        return load_plugins()

    def make_pool(self, case: PoolCase) -> tuple[BaseKVPool, KVLayout]:
        skip_without_device(self.device)
        if case.page_size not in self.page_sizes:
            pytest.skip(f"page size {case.page_size} is not in {type(self).__name__}.page_sizes")
        layout = KVLayout(
            num_layers=self.num_layers,
            num_pages=self.num_pages,
            page_size=case.page_size,
            num_kv_heads=case.num_kv_heads,
            head_dim=case.head_dim,
            dtype=self.dtype,
            device=torch.device(self.device),
        )
        pool = build_component(self.pool, "kv_pool", self.device, self.load_registry, layout)
        assert isinstance(pool, BaseKVPool), f"the pool factory returned {type(pool).__name__}, not a BaseKVPool"
        return pool, layout

    def _random(self, gen: torch.Generator, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=self.device, dtype=self.dtype)

    def _snapshot(self, pool: BaseKVPool, layout: KVLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
        flat = (layout.num_slots, layout.num_kv_heads, layout.head_dim)
        return [
            (pool.k_cache(i).reshape(flat).float().cpu().clone(), pool.v_cache(i).reshape(flat).float().cpu().clone())
            for i in range(layout.num_layers)
        ]

    def _assert_values(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        torch.testing.assert_close(
            got.float().cpu(),
            want.to(self.dtype).float().cpu(),
            atol=self.atol,
            rtol=self.rtol,
            msg=lambda m: f"{what}: {m}",
        )

    @pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: c.id)
    def test_layout(self, case: PoolCase) -> None:
        pool, layout = self.make_pool(case)
        shape = (layout.num_pages, case.page_size, case.num_kv_heads, case.head_dim)
        assert pool.layout == layout, "pool.layout must be the layout the pool was built from"
        for layer in range(layout.num_layers):
            for name, t in (("k_cache", pool.k_cache(layer)), ("v_cache", pool.v_cache(layer))):
                assert tuple(t.shape) == shape, f"{name}({layer}) has shape {tuple(t.shape)}, expected {shape}"
                assert t.dtype == self.dtype, f"{name}({layer}) has dtype {t.dtype}, expected {self.dtype}"
                assert t.device.type == torch.device(self.device).type, f"{name}({layer}) is on {t.device}"

    @pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: c.id)
    def test_store_read_round_trip(self, case: PoolCase) -> None:
        """Scattered slots across pages, one layer at a time: exactly those slots change."""
        pool, layout = self.make_pool(case)
        gen = torch.Generator().manual_seed(self.seed)
        n = min(layout.num_slots, 2 * case.page_size + 3)
        expected = self._snapshot(pool, layout)
        for layer in (layout.num_layers - 1, 0):  # last layer first: catches layer-index mix-ups
            slots = torch.randperm(layout.num_slots, generator=gen)[:n]
            k = self._random(gen, n, case.num_kv_heads, case.head_dim)
            v = self._random(gen, n, case.num_kv_heads, case.head_dim)
            pool.store_kv(k, v, slots.to(self.device), layer)
            expected[layer][0][slots] = k.to(self.dtype).float().cpu()
            expected[layer][1][slots] = v.to(self.dtype).float().cpu()
            got = self._snapshot(pool, layout)
            for i in range(layout.num_layers):
                self._assert_values(got[i][0], expected[i][0], f"K of layer {i} after store_kv(layer={layer})")
                self._assert_values(got[i][1], expected[i][1], f"V of layer {i} after store_kv(layer={layer})")

    @pytest.mark.parametrize("case", POOL_CASES[:4], ids=lambda c: c.id)
    def test_store_overwrites(self, case: PoolCase) -> None:
        """A slot written twice holds the second value (slots are reused after a request finishes)."""
        pool, layout = self.make_pool(case)
        gen = torch.Generator().manual_seed(self.seed + 1)
        slots = torch.tensor([layout.num_slots - 1, case.page_size + 1, 1], dtype=torch.int64)  # distinct, scattered
        shape = (slots.numel(), case.num_kv_heads, case.head_dim)
        for _ in range(2):
            k, v = self._random(gen, *shape), self._random(gen, *shape)
            pool.store_kv(k, v, slots.to(self.device), 0)
        flat = (layout.num_slots, case.num_kv_heads, case.head_dim)
        self._assert_values(pool.k_cache(0).reshape(flat)[slots.to(self.device)], k, "K after overwrite")
        self._assert_values(pool.v_cache(0).reshape(flat)[slots.to(self.device)], v, "V after overwrite")

    def test_store_nothing(self) -> None:
        """An empty store (a batch whose tokens all come from the cache) is a no-op, not an error."""
        case = PoolCase(self.page_sizes[0], 2, 64)
        pool, layout = self.make_pool(case)
        before = self._snapshot(pool, layout)
        empty = torch.empty(0, case.num_kv_heads, case.head_dim, device=self.device, dtype=self.dtype)
        pool.store_kv(empty, empty, torch.empty(0, dtype=torch.int64, device=self.device), 0)
        after = self._snapshot(pool, layout)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, after, strict=True))
