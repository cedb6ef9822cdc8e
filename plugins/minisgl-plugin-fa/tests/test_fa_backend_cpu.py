"""The fa backend's own logic on CPU: page-table conversion, per-batch metadata, CUDA-graph
buffers, shape checks, and the attention conformance kit through each generation's adapter.

The FlashAttention libraries need a GPU, so the adapters here drive stand-ins
(``fa_standins``) that take the libraries' arguments and compute paged attention
in PyTorch. What these tests prove is everything the backend builds around the
kernel call; the kernels themselves are tested by ``test_fa_gpu.py``.
"""

from __future__ import annotations

import random

import pytest
import torch
from fa_standins import fa2_module, fa3_module, fa4_module, paged_attention
from minisgl_plugin_fa.backend import FlashAttnBackend, FlashAttnMetadata, flash_page_table
from minisgl_plugin_fa.kernels import FA2Kernels, FA3Kernels, FA4Kernels, FlashAttnKernels

from minisgl.attention import AttentionContext
from minisgl.core import Batch, Req, SamplingParams
from minisgl.kvcache import KVLayout, MHAKVPool
from minisgl.testing.attention import AttentionBackendConformance, AttentionHarness, AttnCase

MAX_REQS, MAX_SEQ = 8, 128


def fa4_backend(ctx: AttentionContext) -> FlashAttnBackend:
    return FlashAttnBackend(ctx, kernels=FA4Kernels(fa4_module([])))


def fa3_backend(ctx: AttentionContext) -> FlashAttnBackend:
    return FlashAttnBackend(ctx, kernels=FA3Kernels(fa3_module([])))


class TestConformanceThroughFA4Adapter(AttentionBackendConformance):
    backend = staticmethod(fa4_backend)
    dtype = torch.bfloat16


class TestConformanceThroughFA3Adapter(AttentionBackendConformance):
    backend = staticmethod(fa3_backend)
    dtype = torch.bfloat16
    page_sizes = (16,)
    head_dims = (64,)


@pytest.mark.parametrize("gqa", [1, 4])
def test_fa2_adapter_with_256_token_pages(gqa: int) -> None:
    """flash-attn 2 only reads pages of a multiple of 256 tokens: prefill on a cached prefix, then decode."""
    calls: list[str] = []
    h = AttentionHarness(
        lambda ctx: FlashAttnBackend(ctx, kernels=FA2Kernels(fa2_module(calls))),
        MHAKVPool,
        AttnCase(256, gqa, 64),
        dtype=torch.bfloat16,
        tolerance=(3e-2, 3e-2),
        max_len=600,
    )
    hit = h.add_request(300, cached_prefix=256)
    fresh = h.add_request(40)
    h.step([(hit, 44), (fresh, 40)])
    h.step([(hit, 1), (fresh, 1)], "decode")
    assert calls == ["varlen"] * 2 + ["kvcache"] * 2  # two layers per step


# ------------------------------------------------------------------ helpers


class Setup:
    """A pool, minisgl's token-slot table and a backend over a stand-in FlashAttention 4."""

    def __init__(self, page_size: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 64, seed: int = 0):
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.page_size = page_size
        num_pages = MAX_REQS * MAX_SEQ // page_size + 1
        self.layout = KVLayout(1, num_pages, page_size, kv_heads, head_dim, torch.float32, torch.device("cpu"))
        self.pool = MHAKVPool(self.layout)
        self.pool._buffer.normal_()
        self.table = torch.zeros((MAX_REQS, MAX_SEQ), dtype=torch.int32)
        self.free = list(range(1, num_pages))
        self.rng.shuffle(self.free)
        self.ctx = AttentionContext(heads, kv_heads, head_dim, page_size, self.pool, self.table, MAX_REQS, MAX_SEQ,
                                    torch.bfloat16, torch.device("cpu"))  # fmt: skip
        self.calls: list[str] = []
        self.backend = FlashAttnBackend(self.ctx, kernels=FA4Kernels(fa4_module(self.calls)))

    def batch(self, phase: str, specs: list[tuple[int, int]], rows: list[int] | None = None) -> Batch:
        """``specs``: (cached, new) tokens per request, on random pages, in table rows ``rows``."""
        reqs = []
        for i, (cached, new) in enumerate(specs):
            row = rows[i] if rows else i
            total = cached + new
            pages = [self.free.pop() for _ in range(-(-total // self.page_size))]
            slots = (torch.tensor(pages).view(-1, 1) * self.page_size + torch.arange(self.page_size)).view(-1)
            self.table[row, : slots.numel()] = slots.to(torch.int32)
            req = Req(rid=row, input_ids=[0] * total, params=SamplingParams(), max_new_tokens=1)
            req.table_idx, req.cached_len, req.device_len = row, cached, total
            reqs.append(req)
        return Batch(reqs, phase, sample_mask=[True] * len(reqs))

    def pages_of(self, req: Req) -> list[int]:
        slots = self.table[req.table_idx, : req.device_len : self.page_size]
        return (slots // self.page_size).tolist()


# ---------------------------------------------------------- page table


@pytest.mark.parametrize("page_size", [1, 4])
def test_page_table_from_token_slots(page_size: int) -> None:
    """Row r of minisgl's table lists token slots; FlashAttention's row lists the pages they are on."""
    pages = {0: [5, 2, 9], 2: [7, 1, 3]}
    table = torch.full((3, 3 * page_size), -1, dtype=torch.int32)
    for row, ps in pages.items():
        table[row] = torch.tensor([p * page_size + o for p in ps for o in range(page_size)], dtype=torch.int32)
    got = flash_page_table(table, torch.tensor([2, 0]), torch.arange(3) * page_size, page_size)
    assert got.dtype == torch.int32
    assert got.tolist() == [[7, 1, 3], [5, 2, 9]]


def test_prefill_metadata() -> None:
    s = Setup(page_size=16)
    b = s.batch("prefill", [(0, 37), (16, 5), (40, 30)], rows=[3, 0, 5])
    s.backend.prepare_metadata(b)
    meta = b.attn_metadata
    assert isinstance(meta, FlashAttnMetadata)
    assert meta.seqused_k.tolist() == [37, 21, 70]
    assert meta.page_table.dtype == torch.int32 and meta.page_table.shape == (3, 5)  # 70 tokens: 5 pages of 16
    for i, req in enumerate(b.reqs):
        used = s.pages_of(req)
        assert meta.page_table[i, : len(used)].tolist() == used
    assert meta.attend.keywords["cu_seqlens_q"].tolist() == [0, 37, 42, 72]
    assert meta.attend.keywords["max_seqlen_q"] == 37
    assert meta.attend.func == s.backend.kernels.prefill


def test_decode_metadata() -> None:
    s = Setup(page_size=1)
    b = s.batch("decode", [(9, 1), (99, 1)])
    s.backend.prepare_metadata(b)
    meta = b.attn_metadata
    assert meta.seqused_k.tolist() == [10, 100]
    assert meta.page_table.shape == (2, 100)
    assert meta.page_table[0, :10].tolist() == s.table[0, :10].tolist()
    assert "cu_seqlens_q" not in meta.attend.keywords and meta.attend.func == s.backend.kernels.decode


def _reference(s: Setup, batch: Batch, q: torch.Tensor) -> torch.Tensor:
    """Attention of each decode request over its own pages, straight from the token table."""
    c = s.ctx
    rows = []
    for i, req in enumerate(batch.reqs):
        slots = s.table[req.table_idx, : req.device_len].long()
        k = s.pool.k_cache(0).reshape(-1, c.num_kv_heads, c.head_dim)[slots].float()
        v = s.pool.v_cache(0).reshape(-1, c.num_kv_heads, c.head_dim)[slots].float()
        g = c.num_qo_heads // c.num_kv_heads
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        p = (torch.einsum("hd,khd->hk", q[i].float(), k) * c.scale).softmax(-1)
        rows.append(torch.einsum("hk,khd->hd", p, v))
    return torch.stack(rows)


def test_forward_stores_kv_then_attends() -> None:
    s = Setup(page_size=16)
    b = s.batch("prefill", [(20, 12), (0, 3)])
    b.out_loc = torch.cat([s.table[0, 20:32], s.table[1, :3]]).long()
    c = s.ctx
    q = torch.randn(15, c.num_qo_heads * c.head_dim)
    k = torch.randn(15, c.num_kv_heads * c.head_dim)
    v = torch.randn(15, c.num_kv_heads * c.head_dim)
    s.backend.prepare_metadata(b)
    out = s.backend.forward(q, k, v, 0, b)
    assert out.shape == (15, c.num_qo_heads * c.head_dim)
    flat_k = s.pool.k_cache(0).reshape(-1, c.num_kv_heads, c.head_dim)
    assert torch.equal(flat_k[b.out_loc], k.view(15, c.num_kv_heads, c.head_dim))
    assert s.calls == ["varlen"]


# ------------------------------------------------------------ CUDA graphs


def test_graph_buffers_are_refreshed_in_place_for_each_replay() -> None:
    """'Capture' at batch size 8 (the closure bound then is what a graph would replay), then
    replay for 5 and for 3 requests: the captured call must see each batch's pages and lengths."""
    s = Setup(page_size=16, heads=8, kv_heads=2)
    c = s.ctx
    s.backend.init_capture_graph(MAX_SEQ, [1, 2, 4, 8])
    captured = Batch([], "decode", padded_size=8)
    s.backend.prepare_for_capture(captured)
    attend = captured.attn_metadata.attend
    table, seqused = captured.attn_metadata.page_table, captured.attn_metadata.seqused_k
    assert table.shape == (8, MAX_SEQ // 16) and seqused.shape == (8,)
    for lens in ([100, 3, 64, 17, 127], [5, 120, 33]):
        s.free = list(range(1, s.layout.num_pages))
        s.rng.shuffle(s.free)
        b = s.batch("decode", [(n - 1, 1) for n in lens], rows=[7, 0, 2, 5, 1][: len(lens)])
        b.padded_size = 8
        s.backend.prepare_for_replay(b)
        n = len(lens)
        assert seqused.tolist() == lens + [1] * (8 - n)
        assert table[n:, 0].tolist() == [0] * (8 - n)  # padding reads the scratch page
        for i, req in enumerate(b.reqs):
            assert table[i, : -(-lens[i] // 16)].tolist() == s.pages_of(req)
        q = torch.randn(8, c.num_qo_heads, c.head_dim, dtype=torch.bfloat16)
        out = attend(q, s.pool.k_cache(0), s.pool.v_cache(0))  # what the graph replays
        ref = _reference(s, b, q)
        torch.testing.assert_close(out[:n].float(), ref, atol=3e-2, rtol=3e-2)
        assert b.attn_metadata.page_table.data_ptr() == table.data_ptr()


def test_graph_hooks_need_init_first() -> None:
    s = Setup(page_size=16)
    with pytest.raises(RuntimeError, match="init_capture_graph"):
        s.backend.prepare_for_capture(Batch([], "decode", padded_size=4))


# ------------------------------------------------------------ shape checks


@pytest.mark.parametrize(
    "kernels,head_dim,dtype,page_size,message",
    [
        (FA4Kernels, 80, torch.bfloat16, 16, "head_dim 80 is not supported by FlashAttention 4"),
        (FA4Kernels, 128, torch.float32, 16, "runs in bfloat16 or float16, not torch.float32"),
        (FA3Kernels, 48, torch.float16, 1, "head_dim 48 is not supported by FlashAttention 3"),
        (
            FA2Kernels,
            128,
            torch.bfloat16,
            16,
            r"multiple of 256 tokens \(the page size here is 16\); start with --page-size 256",
        ),
    ],
)
def test_factory_rejects_what_the_kernels_cannot_run(
    kernels: type[FlashAttnKernels], head_dim: int, dtype: torch.dtype, page_size: int, message: str
) -> None:
    layout = KVLayout(1, 4, page_size, 2, head_dim, dtype, torch.device("cpu"))
    ctx = AttentionContext(4, 2, head_dim, page_size, MHAKVPool(layout), torch.zeros(1, 64, dtype=torch.int32), 1,
                           64, dtype, torch.device("cpu"))  # fmt: skip
    stand_in = {FA4Kernels: fa4_module, FA3Kernels: fa3_module, FA2Kernels: fa2_module}[kernels]([])
    with pytest.raises(ValueError, match=message):
        FlashAttnBackend(ctx, kernels=kernels(stand_in))


def test_factory_needs_cuda_without_explicit_kernels() -> None:
    s = Setup(page_size=16)
    with pytest.raises(ValueError, match="needs a CUDA device, got 'cpu'; use --attn torch"):
        FlashAttnBackend(s.ctx)


def test_standin_masks_causally_from_the_end() -> None:
    """The stand-in itself: with 3 new queries over 5 keys, query 0 sees keys 0..2 only."""
    k = torch.zeros(1, 8, 1, 4)
    v = torch.arange(8, dtype=torch.float32).view(1, 8, 1, 1).expand(1, 8, 1, 4).contiguous()
    q = torch.zeros(3, 1, 4)
    out = paged_attention(q, k, v, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                          torch.tensor([0, 3], dtype=torch.int32), True, 1.0)  # fmt: skip
    assert out[:, 0, 0].tolist() == [1.0, 1.5, 2.0]  # uniform weights: the mean of the visible values
