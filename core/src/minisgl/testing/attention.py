"""Conformance kit for attention backends.

Subclass :class:`AttentionBackendConformance` in a test module, with a name
starting with ``Test``, and say which backend to test; pytest collects the
inherited tests::

    import torch
    from minisgl.testing.attention import AttentionBackendConformance

    class TestMyBackend(AttentionBackendConformance):
        backend = "mykernel"     # a registry name, an AttentionBackendSpec, "pkg.mod:Class" or a factory
        device = "cuda"
        dtype = torch.bfloat16

Every test drives real :class:`~minisgl.core.Req` and :class:`~minisgl.core.Batch`
objects through the path production runs: slots allocated in a real
:class:`~minisgl.kvcache.KVCacheManager` (host page table), its new entries
mirrored into a device page table and the batch tensors built by the engine's own
:class:`~minisgl.engine.StepInputs`; it runs each batch through the backend
under test and through the built-in ``torch`` backend on a second pool. It checks,
for every layer of every step: output shape and dtype, no NaN/inf, every row close
to the reference (tolerances per dtype), inputs left alone, new K/V stored in
exactly the ``out_loc`` slots of the right layer and no other slot changed. The
reference itself is checked against attention computed in float64.

The matrix: page sizes 1 and 16, 1, 2 and 4 query heads per KV head, head dims 64
and 128; scenarios: fresh prefill of mixed lengths, chunked prefill extending
existing KV (page-aligned prefix-cache hits and unaligned chunk boundaries) mixed
with new requests, several decode steps across page boundaries, and reused pages
that still hold a finished request's KV.

With ``kv_cache_dtype = "fp8_e4m3"`` (or ``"fp8_e5m2"``) both pools store float8 with per-layer scales other
than 1.0 (:data:`KV_TEST_SCALES`): the backend is compared with the torch reference reading
the same quantized cache, stored values must be exactly :func:`~minisgl.kvcache.quantize_kv`
of the new K/V, and the reference is checked against float64 math twice: over the
de-quantized K/V (tight), and over the unquantized K/V within that dtype's
:data:`QUANTIZED_KV_TOLERANCES` (what quantizing the cache costs). Over a quantized cache, a prompt with nothing cached
before the step (a fresh prefill, the first chunk) may instead attend over its new K/V as
computed, without reading them back from the cache (vLLM and SGLang do so): each of its
rows passes if it is close to the reference or to float64 attention over those K/V.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import pytest
import torch

from ..attention import AttentionContext, BaseAttnBackend
from ..attention.torch_backend import TorchAttnBackend
from ..core import Batch, Req, SamplingParams
from ..engine import StepInputs
from ..kvcache import (
    QUANTIZED_KV_DTYPES,
    BaseKVPool,
    KVCacheManager,
    KVLayout,
    MHAKVPool,
    NaivePrefixCache,
    kv_dtype_name,
    quantize_kv,
)
from ..plugins import PluginRegistry, load_plugins
from .kv_pool import ComponentRef, build_component, default_tolerance, skip_without_device


@dataclass(frozen=True)
class AttnCase:
    """One attention shape under test."""

    page_size: int
    gqa: int  # query heads per KV head
    head_dim: int
    num_kv_heads: int = 2

    @property
    def num_qo_heads(self) -> int:
        return self.num_kv_heads * self.gqa

    @property
    def id(self) -> str:
        return f"ps{self.page_size}-gqa{self.gqa}-d{self.head_dim}"


ATTN_CASES = tuple(AttnCase(ps, g, d) for ps in (1, 16) for g in (1, 2, 4) for d in (64, 128))

#: Per-layer (k, v) scales of a quantized test cache (layer ``i`` takes entry ``i % 2``): not 1.0, so a
#: backend that ignores them fails.
KV_TEST_SCALES = ((0.5, 2.0), (2.0, 0.25))
#: ``(atol, rtol)`` within which attention over an FP8 (e4m3) cache of N(0, 1) keys and values agrees
#: with attention over the unquantized cache (e4m3 keeps 3 mantissa bits: up to 6% per value). This bounds
#: what quantizing costs, not a backend: the backend is held to the reference over the same quantized cache.
#: The largest error seen is 0.164 (an H200, the kit's cases: key errors sharpened by the softmax), so 0.2.
QUANTIZED_KV_TOLERANCE = (0.2, 0.1)
#: The same bound per quantized KV cache dtype (:data:`~minisgl.kvcache.QUANTIZED_KV_DTYPES`): e5m2 keeps 2
#: mantissa bits (up to 12.5% per value): the largest error seen in the kit's cases is 0.382 (CPU, float32 and
#: bfloat16; e4m3's there: 0.168), so 0.5.
QUANTIZED_KV_TOLERANCES: dict[str, tuple[float, float]] = {
    "fp8_e4m3": QUANTIZED_KV_TOLERANCE,
    "fp8_e5m2": (0.5, 0.1),
}


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of one request in float64: ``q`` ``[n, hq, d]`` at positions
    ``start .. start + n - 1`` over ``k``/``v`` ``[start + n, hkv, d]``."""
    gqa = q.shape[1] // k.shape[1]
    kx, vx = k.double().repeat_interleave(gqa, dim=1), v.double().repeat_interleave(gqa, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kx) * scale
    allowed = torch.arange(k.shape[0]).view(1, -1) <= (start + torch.arange(q.shape[0])).view(-1, 1)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vx)


class AttentionHarness:
    """Requests in a real :class:`KVCacheManager`, run through a backend and the torch reference.

    Usable on its own (benchmarks, debugging): :meth:`add_request`, then
    :meth:`step` with ``(request, new_tokens)`` pairs; every step is checked.
    """

    def __init__(
        self,
        backend_factory: Callable[[AttentionContext], BaseAttnBackend],
        pool_factory: Callable[[KVLayout], BaseKVPool],
        case: AttnCase,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        tolerance: tuple[float, float] | None = None,
        kv_tolerance: tuple[float, float] = (0.0, 0.0),
        num_layers: int = 2,
        max_reqs: int = 6,
        max_len: int = 64,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
    ):
        self.case = case
        self.device = torch.device(device)
        self.dtype = dtype
        self.atol, self.rtol = tolerance if tolerance is not None else default_tolerance(dtype)
        self.kv_atol, self.kv_rtol = kv_tolerance
        self.num_layers = num_layers
        ps = case.page_size
        num_pages = max_reqs * -(-max_len // ps) + 2
        self.manager = KVCacheManager(num_pages, ps, max_reqs, max_len, NaivePrefixCache(ps))
        # The engine's device state: the page-table mirror and the fed-back tokens (all 0 here).
        self.page_table = torch.zeros(self.manager.table.shape, dtype=torch.int32, device=self.device)
        self.last_token = torch.zeros(max_reqs, dtype=torch.int64, device=self.device)
        if kv_cache_dtype not in ("auto", *QUANTIZED_KV_DTYPES):
            raise ValueError(
                f"kv_cache_dtype must be auto or one of {list(QUANTIZED_KV_DTYPES)}, got {kv_cache_dtype!r}"
            )
        kv_dtype = QUANTIZED_KV_DTYPES.get(kv_cache_dtype, dtype)
        layout = KVLayout(num_layers, num_pages, ps, case.num_kv_heads, case.head_dim, kv_dtype, self.device)
        if layout.quantized:
            scales = [KV_TEST_SCALES[i % len(KV_TEST_SCALES)] for i in range(num_layers)]
            layout = replace(layout, k_scales=tuple(k for k, _ in scales), v_scales=tuple(v for _, v in scales))
        self.layout = layout
        self.pool = pool_factory(layout)
        assert isinstance(self.pool, BaseKVPool), f"the KV pool factory returned {type(self.pool).__name__}"
        ctx = AttentionContext(
            num_qo_heads=case.num_qo_heads,
            num_kv_heads=case.num_kv_heads,
            head_dim=case.head_dim,
            page_size=ps,
            kv_pool=self.pool,
            page_table=self.page_table,
            max_batch_size=max_reqs,
            max_seq_len=self.manager.max_seq_len,
            dtype=dtype,
            device=self.device,
        )
        self.ctx = ctx
        self.backend = backend_factory(ctx)
        assert isinstance(self.backend, BaseAttnBackend), (
            f"the backend factory returned {type(self.backend).__name__}, not a BaseAttnBackend"
        )
        self.reference = TorchAttnBackend(replace(ctx, kv_pool=MHAKVPool(layout)))
        self.gen = torch.Generator().manual_seed(seed)
        # Per request: the K/V of layer 0 so far (float64, CPU), to check the reference against plain math: as the
        # cache holds them (de-quantized), and as computed (the same, for an unquantized cache).
        self.history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.raw_history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.live: list[Req] = []
        self.steps = 0
        self.num_requests = 0

    # ---------------------------------------------------------------- inputs
    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(device=self.device, dtype=self.dtype)

    def _append_history(self, rid: int, k: torch.Tensor, v: torch.Tensor) -> None:
        ks, vs = self.raw_history[rid]
        self.raw_history[rid] = (torch.cat([ks, k.double().cpu()]), torch.cat([vs, v.double().cpu()]))
        kq, vq = self._as_stored(k, v, 0)
        ks, vs = self.history[rid]
        self.history[rid] = (torch.cat([ks, kq.double().cpu()]), torch.cat([vs, vq.double().cpu()]))

    def _as_stored(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache holds for ``k``/``v`` of ``layer``, read back in float32 (de-quantized)."""
        if not self.layout.quantized:
            return k.to(self.dtype).float(), v.to(self.dtype).float()
        ks, vs = self.layout.kv_scales(layer)
        dtype = self.layout.dtype
        return quantize_kv(k, ks, dtype).float() * ks, quantize_kv(v, vs, dtype).float() * vs

    def add_request(self, prompt_len: int, *, cached_prefix: int = 0, max_new_tokens: int = 8) -> Req:
        """Admit a request; ``cached_prefix`` tokens get K/V as if a prefix cache had matched them."""
        rid = self.num_requests
        self.num_requests += 1
        ids = torch.randint(0, 1000, (prompt_len,), generator=self.gen).tolist()
        params = SamplingParams(max_tokens=max_new_tokens)
        req = Req(rid=rid, input_ids=ids, params=params, max_new_tokens=max_new_tokens)
        assert self.manager.try_admit(req), "the harness's KV pool is too small for this scenario"
        empty = torch.empty(0, self.case.num_kv_heads, self.case.head_dim, dtype=torch.float64)
        self.history[rid] = self.raw_history[rid] = (empty, empty)
        self.live.append(req)
        if cached_prefix:
            self.manager.allocate(req, cached_prefix)
            slots = self.manager.table[req.table_idx, :cached_prefix].to(self.device, torch.int64)
            shape = (cached_prefix, self.case.num_kv_heads, self.case.head_dim)
            for layer in range(self.num_layers):
                k, v = self._randn(*shape), self._randn(*shape)
                self.pool.store_kv(k, v, slots, layer)
                self.reference.ctx.kv_pool.store_kv(k, v, slots, layer)
                if layer == 0:
                    self._append_history(rid, k, v)
            req.cached_len = cached_prefix
        return req

    def release(self, req: Req) -> None:
        """Finish ``req``: its row and pages return to the manager (their stale K/V stays in the pool)."""
        self.manager.release(req)
        self.live.remove(req)
        del self.history[req.rid], self.raw_history[req.rid]

    # ------------------------------------------------------------------ step
    def prepare(self, plan: Sequence[tuple[Req, int]], phase: str | None = None) -> Batch:
        """The batch in which each ``req`` computes ``n`` new tokens, prepared as the engine does."""
        for req, n in plan:
            assert n >= 1
            req.device_len = req.cached_len + n
            self.manager.allocate(req, req.device_len)
        if phase is None:
            phase = "decode" if all(n == 1 and r.cached_len >= r.prompt_len for r, n in plan) else "prefill"
        reqs = [r for r, _ in plan]
        batch = Batch(reqs, phase, sample_mask=[r.device_len >= r.prompt_len for r in reqs])
        inputs = StepInputs.build(batch, self.manager.take_new_entries(reqs), self.device)
        inputs.apply(batch, self.page_table, self.last_token)
        return batch

    def step(self, plan: Sequence[tuple[Req, int]], phase: str | None = None) -> None:
        """Run one batch in which each ``req`` computes ``n`` new tokens, and check everything."""
        batch = self.prepare(plan, phase)
        reqs, phase = batch.reqs, batch.phase
        assert batch.positions is not None and batch.out_loc is not None
        owners = [(r.rid, p) for r in reqs for p in range(r.cached_len, r.device_len)]
        out_loc = batch.out_loc.clone()
        tokens = out_loc.numel()
        ref_batch = replace(batch, reqs=list(reqs), positions=batch.positions.clone(), out_loc=out_loc.clone())
        self.backend.prepare_metadata(batch)
        self.reference.prepare_metadata(ref_batch)
        hq, hkv, d = self.case.num_qo_heads, self.case.num_kv_heads, self.case.head_dim
        where = f"step {self.steps} ({phase}, {len(reqs)} requests, {tokens} tokens)"
        for layer in range(self.num_layers):
            before = self._snapshot(layer)
            # Even layers get contiguous q/k/v; odd layers column slices of one fused qkv tensor, the strided
            # views the engine passes (v is always such a slice there, q and k after an in-place rope).
            parts = self._randn(tokens, (hq + 2 * hkv) * d).split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = parts if layer % 2 else (p.contiguous() for p in parts)
            q0, k0, v0 = q.clone(), k.clone(), v.clone()
            if layer % 2 and phase == "prefill" and self.backend.supports_attend_stored:
                # As the prefill graphs run it: K/V stored by the pool first, the output into a given buffer.
                self.pool.store_kv(k.view(tokens, hkv, d), v.view(tokens, hkv, d), batch.out_loc, layer)
                out = torch.full((tokens, hq * d), float("nan"), dtype=self.dtype, device=self.device)
                self.backend.attend_stored(q, k, v, layer, batch, out)
            else:
                out = self.backend.forward(q, k, v, layer, batch)
            want = self.reference.forward(q0.clone(), k0.clone(), v0.clone(), layer, ref_batch)
            at = f"{where}, layer {layer}"
            assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0), f"{at}: forward modified q, k or v"
            fresh = partial(self._fresh_unquantized, q0, k0, v0, plan)
            self._check_output(out, want, (tokens, hq * d), owners, at, fresh)
            if layer == 0:  # plain math is slow; one layer is enough to vouch for the reference
                self._check_reference(q0, k0, v0, want, plan, at)
            self._check_kv(before, out_loc, k0.view(tokens, hkv, d), v0.view(tokens, hkv, d), layer, at)
        for req in reqs:
            req.cached_len = req.device_len
        self.steps += 1

    # ---------------------------------------------------------------- checks
    def _snapshot(self, layer: int, copy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        flat = (self.layout.num_slots, self.case.num_kv_heads, self.case.head_dim)
        k, v = self.pool.k_cache(layer).reshape(flat), self.pool.v_cache(layer).reshape(flat)
        if self.layout.quantized:  # compared as bytes: float8 has few ops on CPU
            k, v = k.view(torch.uint8), v.view(torch.uint8)
        return (k.clone(), v.clone()) if copy else (k, v)

    def _fresh_unquantized(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Sequence[tuple[Req, int]]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a quantized cache: (row mask, float64 attention) of the rows of prompts with nothing cached
        before this step, over their new K/V as computed (what a backend may read instead of the cache)."""
        if not self.layout.quantized:
            return None
        hq, hkv, d = self.case.num_qo_heads, self.case.num_kv_heads, self.case.head_dim
        tokens = q.shape[0]
        mask = torch.zeros(tokens, dtype=torch.bool)
        alt = torch.zeros(tokens, hq * d, dtype=torch.float64)
        start = 0
        for req, n in plan:
            if req.cached_len == 0:
                rows = slice(start, start + n)
                qr, kr, vr = (x[rows].cpu().reshape(n, -1, d) for x in (q, k, v))
                assert kr.shape[1] == hkv
                alt[rows] = reference_attention(qr, kr, vr, 0, self.ctx.scale).reshape(n, hq * d)
                mask[rows] = True
            start += n
        return (mask, alt) if bool(mask.any()) else None

    def _check_output(
        self,
        out: torch.Tensor,
        want: torch.Tensor,
        shape: tuple[int, int],
        owners: list[tuple[int, int]],
        at: str,
        fresh: Callable[[], tuple[torch.Tensor, torch.Tensor] | None] = lambda: None,
    ) -> None:
        assert isinstance(out, torch.Tensor), f"{at}: forward returned {type(out).__name__}, not a tensor"
        assert tuple(out.shape) == shape, f"{at}: output shape {tuple(out.shape)}, expected {shape}"
        assert out.dtype == self.dtype, f"{at}: output dtype {out.dtype}, expected {self.dtype} (the dtype of q)"
        assert out.device.type == self.device.type, f"{at}: output on {out.device}, expected {self.device}"
        got, ref = out.float().cpu(), want.float().cpu()
        finite = torch.isfinite(got).all(dim=1)
        if not bool(finite.all()):
            rows = torch.nonzero(~finite).view(-1).tolist()
            raise AssertionError(f"{at}: NaN/inf in output rows {self._rows(rows, owners)}")
        close = torch.isclose(got, ref, atol=self.atol, rtol=self.rtol).all(dim=1)
        alternative = None if bool(close.all()) else fresh()
        if alternative is not None:  # fresh prompts over a quantized cache: their own K/V are fine too
            mask, alt = alternative
            near = torch.isclose(got.double(), alt, atol=2 * self.atol, rtol=2 * self.rtol).all(dim=1)
            close |= mask & near
        if not bool(close.all()):
            rows = torch.nonzero(~close).view(-1).tolist()
            err = (got - ref).abs().max().item()
            raise AssertionError(
                f"{at}: {len(rows)} of {shape[0]} output rows differ from the torch reference "
                f"(max abs error {err:.3g}, atol {self.atol}, rtol {self.rtol}): {self._rows(rows, owners)}"
            )

    @staticmethod
    def _rows(rows: list[int], owners: list[tuple[int, int]]) -> str:
        shown = ", ".join(f"row {r} = request {owners[r][0]} position {owners[r][1]}" for r in rows[:6])
        return shown + (f", ... ({len(rows)} rows)" if len(rows) > 6 else "")

    def _check_reference(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        want: torch.Tensor,
        plan: Sequence[tuple[Req, int]],
        at: str,
    ) -> None:
        hq, hkv, d = self.case.num_qo_heads, self.case.num_kv_heads, self.case.head_dim
        start = 0
        for req, n in plan:
            rows = slice(start, start + n)
            self._append_history(req.rid, k[rows].view(n, hkv, d), v[rows].view(n, hkv, d))
            ks, vs = self.history[req.rid]
            qr = q[rows].view(n, hq, d).cpu()
            exact = reference_attention(qr, ks, vs, req.cached_len, self.ctx.scale)
            got = want[rows].view(n, hq, d).double().cpu()
            bad = ~torch.isclose(got, exact, atol=2 * self.atol, rtol=2 * self.rtol)
            if bool(bad.any()):
                raise AssertionError(
                    f"{at}: the torch reference disagrees with float64 math for request {req.rid} "
                    f"(max abs error {(got - exact).abs().max().item():.3g}): a bug in the kit or the built-in backend"
                )
            if self.layout.quantized:
                raw = reference_attention(qr, *self.raw_history[req.rid], req.cached_len, self.ctx.scale)
                atol, rtol = QUANTIZED_KV_TOLERANCES[kv_dtype_name(self.layout.dtype)]
                if not bool(torch.isclose(got, raw, atol=atol + self.atol, rtol=rtol).all()):
                    raise AssertionError(
                        f"{at}: attention over the {self.layout.dtype} cache is further from attention over the "
                        f"unquantized K/V than QUANTIZED_KV_TOLERANCES allows for request {req.rid} "
                        f"(max abs error {(got - raw).abs().max().item():.3g}; atol {atol}, rtol {rtol})"
                    )
            start += n

    def _check_kv(
        self,
        before: tuple[torch.Tensor, torch.Tensor],
        out_loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        at: str,
    ) -> None:
        after = self._snapshot(layer, copy=False)
        untouched = torch.ones(self.layout.num_slots, dtype=torch.bool, device=self.device)
        untouched[out_loc] = False
        untouched[: self.case.page_size] = False  # page 0 is scratch: padded entries may write there
        k_want, v_want = self._as_stored(k, v, layer)
        k_scale, v_scale = self.layout.kv_scales(layer)
        for name, old, new, expected, scale in (
            ("K", before[0], after[0], k_want, k_scale),
            ("V", before[1], after[1], v_want, v_scale),
        ):
            held = new[out_loc]
            stored = held.view(self.layout.dtype).float() * scale if self.layout.quantized else held.float()
            bad = ~torch.isclose(stored, expected, atol=self.kv_atol, rtol=self.kv_rtol).flatten(1).all(dim=1)
            if bool(bad.any()):
                rows = torch.nonzero(bad).view(-1).tolist()
                slots = out_loc[rows].tolist()
                raise AssertionError(
                    f"{at}: new {name} of tokens {rows[:8]} not stored in their out_loc slots {slots[:8]}"
                )
            diff = old != new
            if bool(diff.any()):  # the rare slow path: NaN in never-written memory compares unequal to itself
                diff &= ~(old.isnan() & new.isnan())
                changed = torch.nonzero(diff.flatten(1).any(dim=1) & untouched).view(-1).tolist()
                assert not changed, f"{at}: {name} changed in slots outside out_loc: {changed[:8]}"


class AttentionBackendConformance:
    """Base class of an attention backend's conformance tests. Set ``backend``; the rest has defaults.

    ``backend``
        A name in the plugin registry (``load_registry()``), an ``AttentionBackendSpec``,
        a lazy ``"pkg.mod:Class"`` reference, or a factory taking an ``AttentionContext``.
    ``kv_pool``
        The pool the backend reads (same forms; default the built-in ``mha``).
    ``device``, ``dtype``
        Where and in what precision to run; CUDA tests skip without a GPU.
    ``atol``, ``rtol``
        Output tolerance against the reference; ``None`` uses :func:`default_tolerance`.
    ``page_sizes``, ``gqa_ratios``, ``head_dims``
        Restrict the matrix to what the backend supports (other cases skip).
    ``kv_cache_dtype``
        ``"fp8_e4m3"`` or ``"fp8_e5m2"`` for a backend whose spec lists it in ``kv_cache_dtypes``: both pools
        store float8 with per-layer scales (``atol``/``rtol`` then compare two readers of the same quantized cache).
    """

    backend: ComponentRef
    kv_pool: ComponentRef = "mha"
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    atol: float | None = None
    rtol: float | None = None
    kv_atol: float = 0.0
    kv_rtol: float = 0.0
    page_sizes: tuple[int, ...] = (1, 16)
    gqa_ratios: tuple[int, ...] = (1, 2, 4)
    head_dims: tuple[int, ...] = (64, 128)
    num_layers: int = 2
    seed: int = 0
    kv_cache_dtype: str = "auto"

    def load_registry(self) -> PluginRegistry:
        """The registry plain names are looked up in (override to pin plugins)."""
        return load_plugins()

    def make_harness(self, case: AttnCase) -> AttentionHarness:
        skip_without_device(self.device)
        for value, allowed, what in (
            (case.page_size, self.page_sizes, "page_sizes"),
            (case.gqa, self.gqa_ratios, "gqa_ratios"),
            (case.head_dim, self.head_dims, "head_dims"),
        ):
            if value not in allowed:
                pytest.skip(f"{value} is not in {type(self).__name__}.{what}")
        backend = getattr(self, "backend", None)
        if backend is None:
            raise TypeError(f"{type(self).__name__} must set 'backend' (a name, a spec, 'pkg.mod:Class' or a factory)")
        atol, rtol = default_tolerance(self.dtype)

        def make_backend(ctx: AttentionContext) -> Any:
            return build_component(backend, "attention", self.device, self.load_registry, ctx)

        def make_pool(layout: KVLayout) -> Any:
            return build_component(self.kv_pool, "kv_pool", self.device, self.load_registry, layout)

        return AttentionHarness(
            make_backend,
            make_pool,
            case,
            device=self.device,
            dtype=self.dtype,
            tolerance=(self.atol if self.atol is not None else atol, self.rtol if self.rtol is not None else rtol),
            kv_tolerance=(self.kv_atol, self.kv_rtol),
            num_layers=self.num_layers,
            seed=self.seed,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    @pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: c.id)
    def test_prefill_mixed_lengths(self, case: AttnCase) -> None:
        """Fresh prompts of mixed lengths (one token, within a page, exactly a page, several pages)."""
        h = self.make_harness(case)
        ps = case.page_size
        reqs = [h.add_request(n) for n in sorted({1, 7, ps, ps + 1, 2 * ps + 3, 37})]
        h.step([(r, r.prompt_len) for r in reqs])

    @pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: c.id)
    def test_extend_on_cached_prefix(self, case: AttnCase) -> None:
        """New tokens on top of existing KV: a page-aligned prefix-cache hit, unaligned chunk
        boundaries of chunked prefill, a one-token final chunk, and a fresh request, in one batch."""
        h = self.make_harness(case)
        ps = case.page_size
        hit = h.add_request(2 * ps + 9, cached_prefix=2 * ps)
        chunked = h.add_request(24)
        short_tail = h.add_request(ps + 2)
        h.step([(chunked, 13), (short_tail, ps + 1)])  # first chunks
        fresh = h.add_request(5)
        h.step([(hit, 9), (chunked, 11), (short_tail, 1), (fresh, 5)])

    @pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: c.id)
    def test_decode(self, case: AttnCase) -> None:
        """Decode steps after prefill, crossing page boundaries; the batch shrinks as requests finish."""
        h = self.make_harness(case)
        ps = case.page_size
        reqs = [h.add_request(n) for n in sorted({1, max(ps - 1, 2), ps, 2 * ps + 1, 20})]
        h.step([(r, r.prompt_len) for r in reqs])
        for _ in range(3):
            h.step([(r, 1) for r in reqs], "decode")
        h.release(reqs[0])
        h.step([(r, 1) for r in reqs[1:]], "decode")
        h.step([(reqs[-1], 1)], "decode")

    @pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: c.id)
    def test_reused_pages_hold_stale_kv(self, case: AttnCase) -> None:
        """A finished request's pages and table row are reused: its stale K/V must not be read."""
        h = self.make_harness(case)
        old = [h.add_request(40), h.add_request(33)]
        h.step([(r, r.prompt_len) for r in old])
        for r in old:
            h.release(r)
        new = [h.add_request(3), h.add_request(18)]
        h.step([(r, r.prompt_len) for r in new])
        h.step([(r, 1) for r in new], "decode")
