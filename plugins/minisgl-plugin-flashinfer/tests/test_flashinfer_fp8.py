"""The flashinfer backend over an FP8 KV cache (CUDA only): the conformance kit with per-layer scales against the
torch reference reading the same FP8 cache (with and without the ragged prefill of fresh prompts; e4m3, and e5m2
on one shape), and a captured decode graph replayed over an FP8 cache."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from minisgl.attention import AttentionContext, TorchAttnBackend
from minisgl.core import Batch, Req, SamplingParams
from minisgl.kvcache import KVLayout, MHAKVPool
from minisgl.testing.attention import AttentionBackendConformance

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"),
]


class TestFlashInferFP8KVConformance(AttentionBackendConformance):
    """Prefill, extension of cached prefixes (prefix-cache hits), decode and reused pages over an FP8 cache
    whose layers have k/v scales other than 1.0."""

    backend = "flashinfer"
    device = "cuda"
    dtype = torch.bfloat16
    kv_cache_dtype = "fp8_e4m3"


def _paged_only(ctx: AttentionContext) -> object:
    from minisgl_plugin_flashinfer.backend import FlashInferAttnBackend

    return FlashInferAttnBackend(ctx, ragged_prefill=False)


class TestFlashInferFP8KVPagedConformance(AttentionBackendConformance):
    """Every row through the paged kernel (no ragged prefill of fresh prompts): each row then matches the
    reference reading the FP8 cache, with no allowance for fresh prompts' unquantized K/V."""

    backend = staticmethod(_paged_only)
    device = "cuda"
    dtype = torch.bfloat16
    kv_cache_dtype = "fp8_e4m3"
    head_dims = (128,)


class TestFlashInferFP8KVFloat16(AttentionBackendConformance):
    """A float16 model over an FP8 cache (one shape: each dtype pair is another FlashInfer JIT build)."""

    backend = "flashinfer"
    device = "cuda"
    dtype = torch.float16
    kv_cache_dtype = "fp8_e4m3"
    page_sizes = (16,)
    gqa_ratios = (2,)
    head_dims = (128,)


class TestFlashInferE5M2KVConformance(AttentionBackendConformance):
    """An e5m2 cache (``--kv-cache-dtype fp8_e5m2``), held to the torch reference reading it (one shape: each
    dtype pair is another FlashInfer JIT build)."""

    backend = "flashinfer"
    device = "cuda"
    dtype = torch.bfloat16
    kv_cache_dtype = "fp8_e5m2"
    page_sizes = (16,)
    gqa_ratios = (4,)
    head_dims = (128,)


MAX_REQS, MAX_SEQ = 8, 1024


@pytest.mark.parametrize(
    ("fp8", "tensor_cores", "page_size"),
    [(torch.float8_e4m3fn, tc, ps) for tc in (False, True) for ps in (1, 16)] + [(torch.float8_e5m2, True, 16)],
    ids=lambda x: str(x).removeprefix("torch.float8_"),
)
def test_decode_graph_replay_over_fp8_cache(fp8: torch.dtype, tensor_cores: bool, page_size: int) -> None:
    """Capture decode attention at batch size 8 over an FP8 cache with scales, replay it for 5 requests."""
    from minisgl_plugin_flashinfer.backend import FlashInferAttnBackend

    dev, rng = torch.device("cuda"), random.Random(page_size)
    torch.manual_seed(page_size)
    num_pages = MAX_REQS * MAX_SEQ // page_size + 1
    layout = KVLayout(2, num_pages, page_size, 8, 128, fp8, dev, k_scales=(0.5, 2.0), v_scales=(2.0, 0.25))
    pool = MHAKVPool(layout)
    table = torch.zeros((MAX_REQS, MAX_SEQ), dtype=torch.int32, device=dev)
    ctx = AttentionContext(16, 8, 128, page_size, pool, table, MAX_REQS, MAX_SEQ, torch.bfloat16, dev)
    fi, ref = FlashInferAttnBackend(ctx, use_tensor_cores=tensor_cores), TorchAttnBackend(ctx)
    # Every slot holds random K/V, stored through the pool (quantized with layer 1's scales).
    slots = torch.arange(layout.num_slots, device=dev)
    kv = torch.randn(layout.num_slots, 8, 128, device=dev, dtype=torch.bfloat16)
    pool.store_kv(kv, kv.flip(0), slots, 1)
    fi.init_capture_graph(MAX_SEQ, [4, 8])
    static_q = torch.zeros(8, 16 * 128, dtype=torch.bfloat16, device=dev)
    static_k = torch.zeros(8, 8 * 128, dtype=torch.bfloat16, device=dev)
    static_v = torch.zeros_like(static_k)
    static_loc = torch.zeros(8, dtype=torch.int64, device=dev)
    dummy = Batch([], "decode", out_loc=static_loc, padded_size=8)
    fi.prepare_for_capture(dummy)
    fi.forward(static_q, static_k, static_v, 1, dummy)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fi.forward(static_q, static_k, static_v, 1, dummy)
    for round_ in range(2):  # a different batch each time: the plan is refreshed in place
        free = list(range(1, num_pages))
        rng.shuffle(free)
        reqs, locs = [], []
        for row in range(5):
            total = rng.randint(2, 900)
            pages = [free.pop() for _ in range(-(-total // page_size))]
            row_slots = (torch.tensor(pages).view(-1, 1) * page_size + torch.arange(page_size)).view(-1)
            table[row, : row_slots.numel()] = row_slots.to(dev, torch.int32)
            req = Req(rid=row, input_ids=[0] * total, params=SamplingParams(), max_new_tokens=1)
            req.table_idx, req.cached_len, req.device_len = row, total - 1, total
            reqs.append(req)
            locs.append(row_slots[total - 1 : total])
        batch = Batch(reqs, "decode", sample_mask=[True] * 5, padded_size=8)
        batch.out_loc = torch.cat(locs).to(dev)
        q = torch.randn(5, 16 * 128, device=dev, dtype=torch.bfloat16)
        k, v = torch.randn(2, 5, 8 * 128, device=dev, dtype=torch.bfloat16)
        static_q[:5], static_k[:5], static_v[:5] = q, k, v
        static_loc[:5], static_loc[5:] = batch.out_loc, 0
        fi.prepare_for_replay(batch)
        static_out.fill_(float("nan"))
        graph.replay()
        out = static_out[:5].clone()
        assert not torch.isnan(out).any(), f"round {round_}: unwritten output"
        ref.prepare_metadata(batch)
        want = ref.forward(q, k, v, 1, batch)
        err = float((out.float() - want.float()).norm() / want.float().norm())
        assert err < 1e-2, f"round {round_}: relative error {err:.2e} against the torch reference over the FP8 cache"


def test_rejects_a_cache_of_another_dtype() -> None:
    """A float16 cache under a bfloat16 model: neither the model dtype nor a float8 one."""
    from minisgl_plugin_flashinfer.backend import FlashInferAttnBackend

    dev = torch.device("cuda")
    layout = KVLayout(1, 4, 16, 2, 128, torch.float16, dev)
    pool = MHAKVPool(layout)
    ctx = AttentionContext(4, 2, 128, 16, pool, torch.zeros(1, 64, dtype=torch.int32, device=dev), 1, 64,
                           torch.bfloat16, dev)  # fmt: skip
    with pytest.raises(ValueError, match="a torch.float16 KV cache is not supported"):
        FlashInferAttnBackend(ctx)
