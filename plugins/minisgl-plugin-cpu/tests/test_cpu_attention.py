"""The cpu attention backend (native decode, per-request prefill) against the torch reference's padded path."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
from minisgl_plugin_cpu import attention as cpu_backend
from minisgl_plugin_cpu.attention import CPUAttnBackend
from minisgl_plugin_cpu.native import load_cpu_kernels

from minisgl.attention import AttentionContext
from minisgl.attention.torch_backend import TorchAttnBackend, TorchAttnMetadata
from minisgl.core import Batch, Req, SamplingParams
from minisgl.kvcache import KVLayout, MHAKVPool
from minisgl.plugins import Unsupported

needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="the native CPU kernels are unavailable here")


def _decode_setup(page_size: int, hq: int, hkv: int, lengths: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    d, layers = 64, 2
    pages_per_req = -(-max(lengths) // page_size)
    num_pages = len(lengths) * pages_per_req + 1  # page 0 stays scratch
    layout = KVLayout(layers, num_pages, page_size, hkv, d, torch.float32, torch.device("cpu"))
    pool = MHAKVPool(layout)
    for layer in range(layers):  # stale random K/V everywhere, so a wrong slot cannot go unnoticed
        pool.k_cache(layer).copy_(torch.randn(pool.k_cache(layer).shape, generator=gen))
        pool.v_cache(layer).copy_(torch.randn(pool.v_cache(layer).shape, generator=gen))
    max_len = pages_per_req * page_size
    table = torch.zeros(len(lengths), max_len, dtype=torch.int32)
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).view(-1)[: len(lengths) * pages_per_req]
    for i, req_pages in enumerate(pages.view(len(lengths), pages_per_req)):
        table[i] = (req_pages.view(-1, 1) * page_size + torch.arange(page_size)).view(-1)[:max_len].to(torch.int32)
    ctx = AttentionContext(hq, hkv, d, page_size, pool, table, len(lengths), max_len, torch.float32, layout.device)
    reqs = []
    for i, n in enumerate(lengths):
        req = Req(rid=i, input_ids=[0] * n, params=SamplingParams(max_tokens=1), max_new_tokens=1)
        req.table_idx, req.cached_len, req.device_len = i, n - 1, n
        reqs.append(req)
    out_loc = torch.tensor([int(table[i, n - 1]) for i, n in enumerate(lengths)], dtype=torch.int64)
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int64)
    batch = Batch(reqs, "decode", input_ids=torch.zeros(len(reqs), dtype=torch.int64), positions=positions)
    batch.out_loc = out_loc
    return ctx, batch, gen


def _reference(q: torch.Tensor, ctx: AttentionContext, batch: Batch, layer: int) -> torch.Tensor:
    """Per request, in float64: the new token attends to all of its KV."""
    hq, hkv, d = ctx.num_qo_heads, ctx.num_kv_heads, ctx.head_dim
    flat_k = ctx.kv_pool.k_cache(layer).reshape(-1, hkv, d).double()
    flat_v = ctx.kv_pool.v_cache(layer).reshape(-1, hkv, d).double()
    rows = []
    for i, req in enumerate(batch.reqs):
        slots = ctx.page_table[req.table_idx, : req.device_len].long()
        k = flat_k[slots].repeat_interleave(hq // hkv, dim=1)
        v = flat_v[slots].repeat_interleave(hq // hkv, dim=1)
        probs = (torch.einsum("hd,khd->hk", q[i].view(hq, d).double(), k) * ctx.scale).softmax(-1)
        rows.append(torch.einsum("hk,khd->hd", probs, v).reshape(-1))
    return torch.stack(rows)


def _against_padded(
    fast: CPUAttnBackend, fast_batch: Batch, padded: TorchAttnBackend, batch: Batch, n: int, gen: torch.Generator
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Random q/k/v for ``n`` new tokens through both backends, two layers; outputs must agree.

    Yields ``(layer, q, output of fast)`` for further checks.
    """
    ctx = fast.ctx
    hq, hkv, d = ctx.num_qo_heads, ctx.num_kv_heads, ctx.head_dim
    for layer in range(2):
        q = torch.randn(n, hq * d, generator=gen)
        k, v = torch.randn(n, hkv * d, generator=gen), torch.randn(n, hkv * d, generator=gen)
        want = padded.forward(q, k, v, layer, batch)
        got = fast.forward(q, k, v, layer, fast_batch)  # stores the same K/V again
        assert got.shape == (n, hq * d)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        yield layer, q, got


@needs_kernels
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (9, 3), (8, 1)])
def test_per_request_prefill_equals_padded_prefill(page_size: int, hq: int, hkv: int) -> None:
    lengths = [37, 1, 16, 17, 130, 5, 64]
    cached = [0, 0, 15, 3, 0, 4, 63]  # no prefix, a one-token prompt, prefix hits, a decode row
    ctx, batch, gen = _decode_setup(page_size, hq, hkv, lengths, seed=page_size + hq)
    for req, c in zip(batch.reqs, cached, strict=True):
        req.cached_len = c
    new_slots = [ctx.page_table[i, c:n] for i, (c, n) in enumerate(zip(cached, lengths, strict=True))]
    batch.out_loc = torch.cat(new_slots).long()
    per_request, padded = CPUAttnBackend(ctx), TorchAttnBackend(ctx)
    per_request_batch = Batch(**{**batch.__dict__, "attn_metadata": None})
    per_request.prepare_metadata(per_request_batch)
    padded.prepare_metadata(batch)
    assert all(isinstance(r, cpu_backend.PrefillRequest) for r in per_request_batch.attn_metadata)
    assert isinstance(batch.attn_metadata, TorchAttnMetadata)
    for layer, q, got in _against_padded(per_request, per_request_batch, padded, batch, len(batch.out_loc), gen):
        # The last new token of each request against the float64 reference (its full KV).
        last = torch.tensor(list(itertools.accumulate(n_ - c for n_, c in zip(lengths, cached, strict=True)))) - 1
        want_last = _reference(q[last], ctx, batch, layer)
        torch.testing.assert_close(got[last].double(), want_last, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (9, 3), (8, 1)])
def test_native_decode_equals_padded_decode(page_size: int, hq: int, hkv: int) -> None:
    lengths = [37, 1, 16, 17, 130, 5, 64, 129, 33, 130]
    ctx, batch, gen = _decode_setup(page_size, hq, hkv, lengths, seed=page_size * hq)
    native, padded = CPUAttnBackend(ctx), TorchAttnBackend(ctx)
    native_batch = Batch(**{**batch.__dict__, "attn_metadata": None})
    native.prepare_metadata(native_batch)
    padded.prepare_metadata(batch)
    assert isinstance(native_batch.attn_metadata, cpu_backend.NativeDecodeMetadata)
    for layer, q, got in _against_padded(native, native_batch, padded, batch, len(lengths), gen):
        torch.testing.assert_close(got.double(), _reference(q, ctx, batch, layer), atol=1e-5, rtol=1e-5)


def test_cpu_backend_needs_float32_on_cpu() -> None:
    ctx, _, _ = _decode_setup(16, 4, 2, [20, 3], seed=0)
    layout = KVLayout(2, 8, 16, 2, 64, torch.float64, torch.device("cpu"))
    ctx64 = AttentionContext(4, 2, 64, 16, MHAKVPool(layout), ctx.page_table, 2, 64, torch.float64, layout.device)
    with pytest.raises(ValueError, match="runs float32 on CPU"):  # the engine's auto then falls back to torch
        CPUAttnBackend(ctx64)
    TorchAttnBackend(ctx64)  # the reference runs any dtype


def test_cpu_backend_support_check(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(Unsupported, match="CPU only"):
        cpu_backend.supported("cuda")
    monkeypatch.setattr(cpu_backend, "load_cpu_kernels", lambda: None)
    with pytest.raises(Unsupported, match="could not be built"):
        cpu_backend.supported("cpu")
