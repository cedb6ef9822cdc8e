"""Conformance kit for kernel sets: each op against the core's PyTorch :class:`~minisgl.kernel.KernelSet`.

Subclass :class:`KernelSetConformance` in a test module, with a name starting with ``Test``::

    import torch
    from minisgl.testing.kernels import KernelSetConformance

    class TestMyKernels(KernelSetConformance):
        kernel_set = "mykernels"   # a registry name, a KernelSetSpec, "pkg.mod:factory" or a factory
        device = "cuda"
        dtype = torch.bfloat16

Every op runs on the same random inputs through the set under test and through the reference, for
1, 5, 40 and 300 rows (decode batches to prefill chunks), row-major and column-major activations
(what a weight-major GEMM leaves), with and without bias, residual and q/k norm; outputs must agree
within ``atol``/``rtol`` (defaults per dtype) and inputs must be left alone. A CUDA set skips where
torch sees no GPU, and a set whose factory raises ``Unsupported`` skips with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from ..kernel import KernelSet
from ..plugins import ComponentSpec, Unsupported, load_plugins, resolve

ROWS = (1, 5, 40, 300)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


class KernelSetConformance:
    """Base class of a kernel set's conformance tests. Set ``kernel_set``; the rest has defaults."""

    kernel_set: str | ComponentSpec | Callable[..., KernelSet]
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    atol: float | None = None  # None: TOLERANCE[dtype]
    rtol: float | None = None

    def make_kernels(self) -> KernelSet:
        ref = self.kernel_set
        if isinstance(ref, str) and ":" not in ref:
            ref = load_plugins().get("kernels", ref)
        factory = ref.load_factory() if isinstance(ref, ComponentSpec) else resolve(ref)
        return factory(torch.device(self.device), self.dtype)  # type: ignore[no-any-return]

    @pytest.fixture
    def kernels(self) -> KernelSet:
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        try:
            return self.make_kernels()
        except Unsupported as exc:  # e.g. no C compiler for a native set
            pytest.skip(f"the kernel set cannot run here: {exc}")

    def randn(self, *shape: int, seed: int = 0, column_major: bool = False) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        if column_major:
            return torch.randn(*reversed(shape), generator=gen).to(self.device, self.dtype).t()
        return torch.randn(*shape, generator=gen).to(self.device, self.dtype)

    def same(self, got: Any, want: Any) -> None:
        """``got`` equals the reference's ``want`` (tensors, or tuples of them) within the tolerances."""
        tol = TOLERANCE.get(self.dtype, 1e-5)
        atol, rtol = self.atol if self.atol is not None else tol, self.rtol if self.rtol is not None else tol
        for g, w in zip(got, want, strict=True) if isinstance(want, tuple) else [(got, want)]:
            assert g.shape == w.shape and g.dtype == w.dtype, f"{tuple(g.shape)} {g.dtype}, want {tuple(w.shape)}"
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol)

    def run_both(self, kernels: KernelSet, op: str, *args: Any) -> tuple[Any, Any]:
        """``op`` through the set under test and the reference; the inputs must come back unchanged."""
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        got = getattr(kernels, op)(*args)
        for a, b in zip(args, before, strict=True):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f"{op} changed an input"
        return got, getattr(KernelSet(), op)(*args)

    @pytest.mark.parametrize("rows", ROWS)
    @pytest.mark.parametrize("bias", [False, True])
    def test_linear(self, kernels: KernelSet, rows: int, bias: bool) -> None:
        x, weight = self.randn(rows, 96, seed=rows), self.randn(80, 96, seed=1) * 0.1
        b = self.randn(80, seed=2) if bias else None
        self.same(*self.run_both(kernels, "linear", x, weight, b))
        self.same(*self.run_both(kernels, "linear", x.view(rows, 2, 48), weight.view(80, 96)[:, :48], None))

    @pytest.mark.parametrize("rows", ROWS)
    @pytest.mark.parametrize("column_major", [False, True])
    def test_rmsnorm(self, kernels: KernelSet, rows: int, column_major: bool) -> None:
        x, weight = self.randn(rows, 64, seed=rows, column_major=column_major), self.randn(64, seed=3) + 1
        self.same(*self.run_both(kernels, "rmsnorm", x, weight, 1e-6))
        residual = self.randn(rows, 64, seed=4)
        self.same(*self.run_both(kernels, "add_rmsnorm", x, residual, weight, 1e-6))
        self.same(*self.run_both(kernels, "add_rmsnorm", x, None, weight, 1e-6))

    @pytest.mark.parametrize("rows", ROWS)
    @pytest.mark.parametrize("qk_norm", [False, True])
    @pytest.mark.parametrize("column_major", [False, True])
    def test_rope(self, kernels: KernelSet, rows: int, qk_norm: bool, column_major: bool) -> None:
        hq, hkv, d = 6, 2, 64
        qkv = self.randn(rows, (hq + 2 * hkv) * d, seed=rows, column_major=column_major)
        q, k = qkv[:, : hq * d].view(rows, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(rows, hkv, d)
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        freqs = torch.outer(torch.arange(512, dtype=torch.float32), inv)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(self.device)
        positions = torch.randint(0, 512, (rows,), generator=torch.Generator().manual_seed(rows)).to(self.device)
        norm = (self.randn(d, seed=5) + 1, self.randn(d, seed=6) + 1, 1e-6) if qk_norm else None
        self.same(*self.run_both(kernels, "rope", positions, q, k, cos_sin, norm))

    @pytest.mark.parametrize("rows", ROWS)
    @pytest.mark.parametrize("column_major", [False, True])
    def test_silu_mul(self, kernels: KernelSet, rows: int, column_major: bool) -> None:
        self.same(*self.run_both(kernels, "silu_mul", self.randn(rows, 2 * 96, seed=rows, column_major=column_major)))

    @pytest.mark.parametrize("rows", ROWS)
    def test_store_kv(self, kernels: KernelSet, rows: int) -> None:
        heads, d, slots = 2, 64, 512
        k, v = self.randn(rows, heads, d, seed=rows), self.randn(rows, 2 * heads * d, seed=7)[:, : heads * d]
        loc = torch.randperm(slots, generator=torch.Generator().manual_seed(rows))[:rows].to(self.device)
        caches = [self.randn(slots, heads, d, seed=8 + i % 2) for i in range(4)]  # two equal pairs
        kernels.store_kv(k, v.view(rows, heads, d), loc, caches[0], caches[1])
        KernelSet().store_kv(k, v.view(rows, heads, d), loc, caches[2], caches[3])
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])

    @pytest.mark.parametrize("rows", ROWS)
    @pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5)])
    @pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
    def test_store_kv_quantized(
        self, kernels: KernelSet, rows: int, scales: tuple[float, float], fp8: torch.dtype
    ) -> None:
        """Into float8 (e4m3 or e5m2) caches: the same bytes as the reference (quantize_kv, then a byte store),
        values past the format's range clamped, the untouched slots left as they were."""
        heads, d, slots = 2, 64, 512
        # N(0, 1) times this passes the format's range after the scale (the clamp matters), short of the inputs'.
        big = min(0.7 * torch.finfo(fp8).max, 0.2 * torch.finfo(self.dtype).max)
        k = self.randn(rows, heads, d, seed=rows) * big
        v = (self.randn(rows, 2 * heads * d, seed=7) * big)[:, : heads * d]  # a strided slice, as qkv's v is
        loc = torch.randperm(slots, generator=torch.Generator().manual_seed(rows))[:rows].to(self.device)
        caches = [self.randn(slots, heads, d, seed=8 + i % 2).to(fp8) for i in range(4)]  # two equal pairs
        before = k.clone(), v.clone()
        kernels.store_kv_quantized(k, v.view(rows, heads, d), loc, caches[0], caches[1], *scales)
        KernelSet().store_kv_quantized(k, v.view(rows, heads, d), loc, caches[2], caches[3], *scales)
        assert torch.equal(k, before[0]) and torch.equal(v, before[1]), "store_kv_quantized changed an input"
        for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            assert not got.float().isnan().any()

    @pytest.mark.parametrize("rows", ROWS)
    def test_argmax(self, kernels: KernelSet, rows: int) -> None:
        logits = self.randn(rows, 1000, seed=rows).float()
        got, want = self.run_both(kernels, "argmax", logits)
        assert torch.equal(got, want)

    def test_gumbel_sample(self, kernels: KernelSet) -> None:
        """Optional: temperature 0 rows are the argmax, and the draw is a function of the seed."""
        if kernels.gumbel_sample is None:
            pytest.skip("this set has no fused sampling")
        logits = self.randn(40, 5000, seed=9).float()
        inv_t = torch.tensor([0.0, 1.0] * 20, device=self.device)
        first = kernels.gumbel_sample(logits, inv_t, 123)
        assert torch.equal(first, kernels.gumbel_sample(logits, inv_t, 123))
        assert torch.equal(first[::2], logits.argmax(-1)[::2])
        assert ((first >= 0) & (first < 5000)).all()
