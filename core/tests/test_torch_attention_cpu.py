"""The torch backend's CPU decode path (requests grouped by KV length) against its generic padded path."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from minisgl.attention import AttentionContext, torch_backend
from minisgl.attention.torch_backend import TorchAttnBackend, TorchDecodeMetadata, group_by_length
from minisgl.core import Batch, Req, SamplingParams
from minisgl.kvcache import KVLayout, MHAKVPool


def _padded_cost(groups: list[list[int]], lengths: list[int], overhead: int) -> int:
    return sum(overhead + len(g) * max(lengths[i] for i in g) for g in groups)


@pytest.mark.parametrize("lengths", [[5], [7, 7, 7], [1, 300, 2, 299, 150], [30, 10, 20, 10, 40, 35, 200, 210]])
@pytest.mark.parametrize("overhead", [0, 16, 256, 10_000])
def test_group_by_length_is_an_optimal_partition(lengths: list[int], overhead: int) -> None:
    groups = group_by_length(lengths, overhead)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    maxima = [max(lengths[i] for i in g) for g in groups]
    assert maxima == sorted(maxima), "groups come out shortest first"
    # Brute force over every split of the sorted order into runs.
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    best = min(
        _padded_cost([order[a:b] for a, b in itertools.pairwise((0, *cuts, len(order)))], lengths, overhead)
        for k in range(len(order))
        for cuts in itertools.combinations(range(1, len(order)), k)
    )
    assert _padded_cost(groups, lengths, overhead) == best


def test_group_by_length_extremes() -> None:
    assert group_by_length([4, 4, 4, 4], 0) == [[0, 1, 2, 3]]
    assert group_by_length([9, 1, 5], 0) == [[1], [2], [0]]
    assert group_by_length([9, 1, 5], 10_000) == [[1, 2, 0]]
    assert group_by_length([], 10) == []


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
    fast: TorchAttnBackend, fast_batch: Batch, padded: TorchAttnBackend, batch: Batch, n: int, gen: torch.Generator
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


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("overhead", [0, 32, 10_000])
def test_grouped_decode_equals_padded_decode(
    page_size: int, hq: int, hkv: int, overhead: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch_backend, "GROUP_OVERHEAD_TOKENS", overhead)
    lengths = [37, 1, 16, 17, 130, 5, 64, 129, 33, 130]
    ctx, batch, gen = _decode_setup(page_size, hq, hkv, lengths, seed=page_size + hq)
    grouped = TorchAttnBackend(ctx, grouped_decode=True, native_decode=False)
    padded = TorchAttnBackend(ctx, grouped_decode=False, native_decode=False)
    grouped_batch = Batch(**{**batch.__dict__, "attn_metadata": None})
    grouped.prepare_metadata(grouped_batch)
    padded.prepare_metadata(batch)
    meta = grouped_batch.attn_metadata
    assert isinstance(meta, TorchDecodeMetadata)
    if overhead == 0:
        assert len(meta.groups) == len(set(lengths))
    if overhead == 10_000:
        assert len(meta.groups) == 1 and meta.groups[0].rows is None
    for layer, q, got in _against_padded(grouped, grouped_batch, padded, batch, len(lengths), gen):
        torch.testing.assert_close(got.double(), _reference(q, ctx, batch, layer), atol=1e-5, rtol=1e-5)


def test_equal_lengths_need_no_mask() -> None:
    ctx, batch, _ = _decode_setup(16, 4, 2, [20, 20, 20], seed=0)
    TorchAttnBackend(ctx, grouped_decode=True, native_decode=False).prepare_metadata(batch)
    meta = batch.attn_metadata
    assert isinstance(meta, TorchDecodeMetadata)
    assert [g.mask for g in meta.groups] == [None]


def test_grouped_decode_is_cpu_default_and_skips_prefill() -> None:
    ctx, batch, _ = _decode_setup(16, 4, 2, [20, 3], seed=0)
    assert TorchAttnBackend(ctx).grouped_decode
    batch.reqs[0].cached_len = 10  # 10 new tokens: a prefill chunk takes the padded path
    TorchAttnBackend(ctx, native_decode=False).prepare_metadata(batch)
    assert not isinstance(batch.attn_metadata, TorchDecodeMetadata)


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
    per_request, padded = TorchAttnBackend(ctx), TorchAttnBackend(ctx, per_request_prefill=False)
    assert per_request.per_request_prefill
    per_request_batch = Batch(**{**batch.__dict__, "attn_metadata": None})
    per_request.prepare_metadata(per_request_batch)
    padded.prepare_metadata(batch)
    assert isinstance(per_request_batch.attn_metadata, torch_backend.TorchPrefillMetadata)
    assert isinstance(batch.attn_metadata, torch_backend.TorchAttnMetadata)
    for layer, q, got in _against_padded(per_request, per_request_batch, padded, batch, len(batch.out_loc), gen):
        # The last new token of each request against the float64 reference (its full KV).
        last = torch.tensor(list(itertools.accumulate(n_ - c for n_, c in zip(lengths, cached, strict=True)))) - 1
        want_last = _reference(q[last], ctx, batch, layer)
        torch.testing.assert_close(got[last].double(), want_last, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (9, 3), (8, 1)])
def test_native_decode_equals_padded_decode(page_size: int, hq: int, hkv: int) -> None:
    from minisgl.kernel import cpu

    lengths = [37, 1, 16, 17, 130, 5, 64, 129, 33, 130]
    ctx, batch, gen = _decode_setup(page_size, hq, hkv, lengths, seed=page_size * hq)
    native = TorchAttnBackend(ctx)
    if cpu.load_cpu_kernels() is None:
        assert native.native is None
        pytest.skip("the native CPU kernels are unavailable here")
    assert native.native is not None, "float32 on CPU decodes with the native kernel by default"
    padded = TorchAttnBackend(ctx, grouped_decode=False, native_decode=False)
    native_batch = Batch(**{**batch.__dict__, "attn_metadata": None})
    native.prepare_metadata(native_batch)
    padded.prepare_metadata(batch)
    assert isinstance(native_batch.attn_metadata, torch_backend.NativeDecodeMetadata)
    for layer, q, got in _against_padded(native, native_batch, padded, batch, len(lengths), gen):
        torch.testing.assert_close(got.double(), _reference(q, ctx, batch, layer), atol=1e-5, rtol=1e-5)


def test_native_decode_needs_float32_on_cpu() -> None:
    ctx, _, _ = _decode_setup(16, 4, 2, [20, 3], seed=0)
    layout = KVLayout(2, 8, 16, 2, 64, torch.float64, torch.device("cpu"))
    ctx64 = AttentionContext(4, 2, 64, 16, MHAKVPool(layout), ctx.page_table, 2, 64, torch.float64, layout.device)
    assert TorchAttnBackend(ctx64).native is None
    with pytest.raises(ValueError, match="native_decode needs CPU float32"):
        TorchAttnBackend(ctx64, native_decode=True)
