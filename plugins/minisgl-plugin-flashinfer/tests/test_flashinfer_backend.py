"""The flashinfer backend against the torch reference on random paged batches (CUDA only).

Every check draws fresh random K/V, queries and page placements, poisons the
output buffer with NaN first, and compares with the ``torch`` backend by
relative error ``|out - ref| / |ref|``.
"""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import pytest
import torch

from minisgl.attention import AttentionContext, TorchAttnBackend
from minisgl.core import Batch, Req, SamplingParams
from minisgl.kvcache import KVLayout, MHAKVPool

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"),
]

MAX_REQS = 16
MAX_SEQ = 1024


class Setup:
    """A KV pool, a page table and both backends over them."""

    def __init__(
        self,
        page_size: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int,
        tensor_cores: bool | None = None,
        ragged: bool | None = None,
        split_decode: bool | None = None,
    ):
        from minisgl_plugin_flashinfer.backend import FlashInferAttnBackend

        self.dev = torch.device("cuda")
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.page_size = page_size
        num_pages = MAX_REQS * MAX_SEQ // page_size + 1
        self.layout = KVLayout(2, num_pages, page_size, kv_heads, head_dim, dtype, self.dev)
        self.pool = MHAKVPool(self.layout)
        # Random, well-spread contents for the whole pool: cached prefixes read from it.
        self.pool._buffer.normal_()
        self.table = torch.zeros((MAX_REQS, MAX_SEQ), dtype=torch.int32, device=self.dev)
        self.free_pages = list(range(1, num_pages))
        self.rng.shuffle(self.free_pages)
        self.ctx = AttentionContext(
            num_qo_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            kv_pool=self.pool,
            page_table=self.table,
            max_batch_size=MAX_REQS,
            max_seq_len=MAX_SEQ,
            dtype=dtype,
            device=self.dev,
        )
        self.fi = FlashInferAttnBackend(
            self.ctx, use_tensor_cores=tensor_cores, ragged_prefill=ragged, split_decode=split_decode
        )
        self.ref = TorchAttnBackend(self.ctx)

    def make_batch(self, phase: str, specs: list[tuple[int, int]], first_row: int = 0) -> Batch:
        """``specs``: (cached tokens, new tokens) per request, in page-table rows from ``first_row``; pages
        placed at random."""
        reqs = []
        locs = []
        for row, (cached, new) in enumerate(specs, start=first_row):
            total = cached + new
            pages = [self.free_pages.pop() for _ in range(-(-total // self.page_size))]
            slots = (torch.tensor(pages).view(-1, 1) * self.page_size + torch.arange(self.page_size)).view(-1)
            self.table[row, : slots.numel()] = slots.to(self.dev, torch.int32)
            req = Req(rid=row, input_ids=[0] * total, params=SamplingParams(), max_new_tokens=1)
            req.table_idx, req.cached_len, req.device_len = row, cached, total
            reqs.append(req)
            locs.append(slots[cached:total])
        batch = Batch(reqs, phase, sample_mask=[True] * len(reqs))
        batch.out_loc = torch.cat(locs).to(self.dev)
        return batch

    def qkv(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.ctx
        q = torch.randn(tokens, c.num_qo_heads * c.head_dim, device=self.dev, dtype=c.dtype)
        k = torch.randn(tokens, c.num_kv_heads * c.head_dim, device=self.dev, dtype=c.dtype)
        v = torch.randn(tokens, c.num_kv_heads * c.head_dim, device=self.dev, dtype=c.dtype)
        return q, k, v


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _rerun(setup: Setup, batch: Batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The planned kernels once more, into a NaN-poisoned buffer (so an unwritten element shows)."""
    from minisgl_plugin_flashinfer.backend import FlashInferMetadata

    c, meta = setup.ctx, batch.attn_metadata
    assert isinstance(meta, FlashInferMetadata)
    hq, hkv, d = c.num_qo_heads, c.num_kv_heads, c.head_dim
    q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
    out = torch.full((q.shape[0], hq, d), float("nan"), dtype=c.dtype, device=setup.dev)
    kv = (setup.pool.k_cache(layer), setup.pool.v_cache(layer))
    s = meta.decode_tokens
    t = meta.paged_tokens if meta.ragged is not None else q.shape[0]
    if meta.decode is not None:
        meta.decode.run(q[:s], kv, out=out[:s])
    if meta.wrapper is not None:
        meta.wrapper.run(q[s:t], kv, out=out[s:t])
    if meta.ragged is not None:
        meta.ragged.run(q[t:], k[t:], v[t:], out=out[t:])
    return out.view(-1, hq * d)


def _check(setup: Setup, batch: Batch, layer: int = 1) -> Any:
    """Checks the batch through flashinfer against torch; returns flashinfer's metadata (the batch then holds the
    reference's)."""
    assert batch.out_loc is not None
    q, k, v = setup.qkv(batch.out_loc.numel())
    setup.fi.prepare_metadata(batch)
    out = setup.fi.forward(q, k, v, layer, batch)
    poisoned = _rerun(setup, batch, q, k, v, layer)
    assert not torch.isnan(poisoned).any(), "flashinfer left output elements unwritten"
    assert _rel_err(poisoned, out) < 1e-3
    meta = batch.attn_metadata
    setup.ref.prepare_metadata(batch)
    ref = setup.ref.forward(q, k, v, layer, batch)
    assert not torch.isnan(out).any()
    err = _rel_err(out, ref)
    assert err < 1e-2, f"relative error {err:.2e} against the torch backend"
    return meta


GQA = [(8, 4), (16, 4)]  # 2:1 and 4:1


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_prefill_with_cached_prefix_matches_torch(page_size: int, heads: int, kv_heads: int) -> None:
    s = Setup(page_size, heads, kv_heads, 128, torch.bfloat16, seed=page_size * 100 + heads)
    specs = [(0, 37), (16, 1), (100, 64), (5, 200), (0, 1), (257, 33)]
    _check(s, s.make_batch("prefill", specs))


# Rows with nothing cached at the end of the batch take the ragged kernel; the rest the paged one.
MIXED_SPECS = [
    [(16, 1), (100, 64), (0, 37), (0, 200)],  # decode row and later chunk, then two fresh prompts
    [(16, 1), (300, 1), (1000, 1), (7, 1), (100, 64), (0, 37)],  # decode rows first, as the scheduler puts them
    [(0, 37), (0, 1), (0, 300)],  # every row fresh: no paged kernel at all
    [(0, 37), (5, 20), (0, 64)],  # a fresh row before a cached one stays paged
]


MIXED_IDS = ["mixed", "decodes-first", "all-fresh", "interleaved"]


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("specs", MIXED_SPECS, ids=MIXED_IDS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_fresh_prompts_match_torch(
    page_size: int, heads: int, kv_heads: int, specs: list[tuple[int, int]], ragged: bool
) -> None:
    _check_mixed(page_size, heads, kv_heads, specs, ragged, split_decode=False)


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("specs", MIXED_SPECS, ids=MIXED_IDS)
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_split_decode_matches_torch(heads: int, kv_heads: int, specs: list[tuple[int, int]], ragged: bool) -> None:
    """split_decode: a mixed batch's leading one-token rows through the decode kernel."""
    _check_mixed(16, heads, kv_heads, specs, ragged, split_decode=True)


def _check_mixed(
    page_size: int, heads: int, kv_heads: int, specs: list[tuple[int, int]], ragged: bool, split_decode: bool
) -> None:
    s = Setup(
        page_size, heads, kv_heads, 128, torch.bfloat16, seed=page_size * 31 + heads, ragged=ragged,
        split_decode=split_decode,
    )  # fmt: skip
    batch = s.make_batch("prefill", specs)
    meta = _check(s, batch)
    from minisgl_plugin_flashinfer.backend import decode_rows, ragged_split

    first = decode_rows(batch.reqs) if split_decode else 0
    assert (meta.decode is not None) == (first > 0) and meta.decode_tokens == first
    split = first + ragged_split(batch.reqs[first:]) if ragged else len(specs)
    assert (meta.ragged is not None) == (split < len(specs))
    assert (meta.wrapper is not None) == (split > first)
    if meta.ragged is not None:
        assert meta.paged_tokens == sum(new for _, new in specs[:split])


def test_ragged_and_paged_prefill_agree() -> None:
    """The same batch through the ragged kernel and through the paged one: the same attention."""
    on = Setup(16, 16, 4, 128, torch.bfloat16, seed=5, ragged=True)
    off = Setup(16, 16, 4, 128, torch.bfloat16, seed=5, ragged=False)
    specs = [(40, 1), (0, 129), (0, 3)]
    batch_on, batch_off = on.make_batch("prefill", specs), off.make_batch("prefill", specs)
    q, k, v = on.qkv(batch_on.out_loc.numel())
    on.fi.prepare_metadata(batch_on)
    off.fi.prepare_metadata(batch_off)
    assert batch_on.attn_metadata.ragged is not None and batch_off.attn_metadata.ragged is None
    a = on.fi.forward(q, k, v, 0, batch_on)
    b = off.fi.forward(q, k, v, 0, batch_off)
    assert _rel_err(a, b) < 5e-3


@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_decode_matches_torch(page_size: int, heads: int, kv_heads: int, tensor_cores: bool) -> None:
    s = Setup(page_size, heads, kv_heads, 128, torch.bfloat16, seed=page_size * 7 + heads, tensor_cores=tensor_cores)
    specs = [(c, 1) for c in (0, 1, 15, 16, 17, 300, 511, 1000)]
    _check(s, s.make_batch("decode", specs))


@pytest.mark.parametrize(
    "head_dim,dtype", [(64, torch.float16), (256, torch.bfloat16), (128, torch.float16), (64, torch.bfloat16)]
)
def test_head_dims_and_dtypes(head_dim: int, dtype: torch.dtype) -> None:
    s = Setup(16, 8, 2, head_dim, dtype, seed=head_dim)
    _check(s, s.make_batch("prefill", [(0, 50), (33, 20), (64, 1)]))
    s2 = Setup(16, 8, 2, head_dim, dtype, seed=head_dim + 1)
    _check(s2, s2.make_batch("decode", [(10, 1), (100, 1), (31, 1)]))


@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_graph_replay_matches_torch(page_size: int, tensor_cores: bool) -> None:
    """Capture decode attention at batch size 8, replay it for 5 real requests (3 padded)."""
    s = Setup(page_size, 16, 8, 128, torch.bfloat16, seed=42 + page_size, tensor_cores=tensor_cores)
    c = s.ctx
    s.fi.init_capture_graph(MAX_SEQ, [4, 8])
    static_q = torch.zeros(8, c.num_qo_heads * c.head_dim, dtype=c.dtype, device=s.dev)
    static_k = torch.zeros(8, c.num_kv_heads * c.head_dim, dtype=c.dtype, device=s.dev)
    static_v = torch.zeros_like(static_k)
    static_loc = torch.zeros(8, dtype=torch.int64, device=s.dev)
    dummy = Batch([], "decode", out_loc=static_loc, padded_size=8)
    s.fi.prepare_for_capture(dummy)
    s.fi.forward(static_q, static_k, static_v, 0, dummy)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = s.fi.forward(static_q, static_k, static_v, 0, dummy)
    for round_ in range(2):  # replay twice with different batches: the plan must be refreshed in place
        s.free_pages = list(range(1, s.layout.num_pages))
        s.rng.shuffle(s.free_pages)
        lens = [s.rng.randint(1, 900) for _ in range(5)]
        batch = s.make_batch("decode", [(n, 1) for n in lens])
        batch.padded_size = 8
        q, k, v = s.qkv(5)
        static_q[:5], static_k[:5], static_v[:5] = q, k, v
        static_loc[:5] = batch.out_loc
        static_loc[5:] = 0
        s.fi.prepare_for_replay(batch)
        static_out.fill_(float("nan"))
        graph.replay()
        out = static_out[:5].clone()
        assert not torch.isnan(out).any(), f"round {round_}: unwritten output"
        s.ref.prepare_metadata(batch)
        ref = s.ref.forward(q, k, v, 0, batch)
        err = _rel_err(out, ref)
        assert err < 1e-2, f"round {round_}: relative error {err:.2e}"


def test_rejects_unsupported_head_dim() -> None:
    from minisgl_plugin_flashinfer.backend import FlashInferAttnBackend

    s_layout = KVLayout(1, 4, 16, 2, 96, torch.bfloat16, torch.device("cuda"))
    ctx = AttentionContext(
        4,
        2,
        96,
        16,
        MHAKVPool(s_layout),
        torch.zeros(1, 64, dtype=torch.int32, device="cuda"),
        1,
        64,
        torch.bfloat16,
        torch.device("cuda"),
    )
    with pytest.raises(ValueError, match="head_dim 96 is not supported"):
        FlashInferAttnBackend(ctx)


def test_a_plan_is_not_overwritten_before_its_copy_runs() -> None:
    """Two batches planned on one wrapper while the device is still busy, as when the host runs steps ahead
    (the chunks of a long prompt, which sample nothing): the first batch must run with its own plan. FlashInfer
    copies a plan to the device from one page-locked buffer per wrapper, in stream order, so without the wait
    the second plan would be what the first batch's kernels read."""
    s = Setup(16, 16, 4, 128, torch.bfloat16, seed=11)
    first = s.make_batch("prefill", [(160, 160)])  # a later chunk of a long prompt
    second = s.make_batch("prefill", [(320, 160), (0, 700)], first_row=1)  # more requests, tiles and KV
    q1, k1, v1 = s.qkv(160)
    q2, k2, v2 = s.qkv(860)
    torch.cuda._sleep(300_000_000)  # keeps the device busy well past the host's work below
    s.fi.prepare_metadata(first)
    out1 = s.fi.forward(q1, k1, v1, 0, first)
    s.fi.prepare_metadata(second)
    out2 = s.fi.forward(q2, k2, v2, 0, second)
    torch.cuda.synchronize()
    for batch, (q, k, v), out in ((first, (q1, k1, v1), out1), (second, (q2, k2, v2), out2)):
        s.ref.prepare_metadata(batch)
        ref = s.ref.forward(q, k, v, 0, batch)
        assert torch.isfinite(out).all()
        err = _rel_err(out, ref)
        assert err < 1e-2, f"relative error {err:.2e} against the torch backend"
