"""The real kernels (FlashInfer installed; the GPU tests need CUDA): against the torch reference.

On Hopper (compute capability 9.0) the XQA decode kernel runs and is checked here
like the other backends: the conformance kit, random paged batches, CUDA-graph
replay and greedy decoding of tiny models; the trtllm-gen kernels must be refused
there with their reason. On compute capability 10.0/10.3 the ``trtllm`` backend's
kit runs too. The XQA shapes used here are compiled ahead by gpu/prebuild.py.
"""

from __future__ import annotations

import importlib.util
import inspect
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from greedy_agreement import FP8_LOGPROB_P90_NATS, FP8_TIE_NATS, TIE_NATS, check_divergences, check_logprobs
from trtllm_emulation import EmulatedKernels

from minisgl import LLM, SamplingParams
from minisgl.attention import AttentionContext, HybridAttnBackend, TorchAttnBackend
from minisgl.core import Batch, Req
from minisgl.kvcache import KVLayout, MHAKVPool
from minisgl.testing.attention import KV_TEST_SCALES, QUANTIZED_KV_TOLERANCE, AttentionBackendConformance
from minisgl.testing.models import random_prompts, save_tiny_model

flashinfer = pytest.importorskip("flashinfer", reason="FlashInfer is not installed")
T = TypeVar("T")

CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
ON_GPU = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
XQA = [*ON_GPU, pytest.mark.skipif(CAPABILITY[0] not in (9, 10, 12), reason="XQA needs compute capability 9/10/12")]
TRTLLM_GEN = [
    *ON_GPU,
    pytest.mark.skipif(CAPABILITY not in ((10, 0), (10, 3)), reason="trtllm-gen needs compute capability 10.0/10.3"),
]
NOT_TRTLLM_GEN = [*ON_GPU, pytest.mark.skipif(CAPABILITY in ((10, 0), (10, 3)), reason="this GPU runs trtllm-gen")]


def marks(*decorators: pytest.MarkDecorator) -> Callable[[T], T]:
    """Apply several marks at once."""

    def apply(test: T) -> T:
        for mark in decorators:
            test = mark(test)
        return test

    return apply


def test_emulation_has_flashinfer_signatures() -> None:
    """The CPU tests' stand-ins take exactly FlashInfer's parameters, so the backend's calls bind here too."""
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache
    from flashinfer.prefill import trtllm_batch_context_with_kv_cache

    emu = EmulatedKernels()
    for real, fake in (
        (trtllm_batch_decode_with_kv_cache, emu.trtllm_batch_decode_with_kv_cache),
        (trtllm_batch_context_with_kv_cache, emu.trtllm_batch_context_with_kv_cache),
    ):
        want = [(p.name, p.default) for p in inspect.signature(real).parameters.values()]
        got = [(p.name, p.default) for p in inspect.signature(fake).parameters.values()]
        assert got == want, real.__name__


# ------------------------------------------------------------------ the conformance kit
class TestXqaConformance(AttentionBackendConformance):
    backend = "trtllm-xqa"
    device = "cuda"
    dtype = torch.bfloat16
    page_sizes = (16,)
    head_dims = (128,)
    pytestmark = XQA


class TestXqaConformanceHead64(AttentionBackendConformance):
    backend = "trtllm-xqa"
    device = "cuda"
    dtype = torch.bfloat16
    page_sizes = (16,)
    gqa_ratios = (4,)
    head_dims = (64,)
    pytestmark = XQA


class TestXqaFP8KVConformance(AttentionBackendConformance):
    """XQA over an FP8 cache with per-layer k/v scales (prefill through the torch fallback). On Hopper XQA's FP8
    kernel also rounds the query and the probabilities to e4m3 (3 mantissa bits), as the cache's keys were, so
    it is held to the torch reader of the same cache within what quantizing costs, QUANTIZED_KV_TOLERANCE."""

    backend = "trtllm-xqa"
    device = "cuda"
    dtype = torch.bfloat16
    kv_cache_dtype = "fp8_e4m3"
    atol, rtol = QUANTIZED_KV_TOLERANCE
    page_sizes = (16,)
    gqa_ratios = (4,)
    head_dims = (128,)
    pytestmark = XQA


class TestTrtllmGenConformance(AttentionBackendConformance):
    backend = "trtllm"
    device = "cuda"
    dtype = torch.bfloat16
    page_sizes = (16,)
    pytestmark = TRTLLM_GEN


# ------------------------------------------------------------------ random paged batches
MAX_REQS, MAX_SEQ = 64, 2048


class Setup:
    """A pool with random contents, randomly placed pages, the backend under test and the torch reference."""

    def __init__(
        self,
        heads: int,
        kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        seed: int,
        kv_dtype: torch.dtype | None = None,
    ):
        from minisgl_plugin_trtllm.backend import build_xqa

        self.dev = torch.device("cuda")
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.ps = page_size
        self.num_pages = MAX_REQS * MAX_SEQ // page_size + 1
        kv_dtype = kv_dtype or dtype
        scales: dict[str, tuple[float, ...]] = {}
        if kv_dtype != dtype:  # a quantized cache: the kit's scales (not 1.0), so a backend that drops them fails
            scales = {"k_scales": tuple(k for k, _ in KV_TEST_SCALES), "v_scales": tuple(v for _, v in KV_TEST_SCALES)}
        layout = KVLayout(2, self.num_pages, page_size, kv_heads, head_dim, kv_dtype, self.dev, **scales)
        self.pool = MHAKVPool(layout)
        if kv_dtype == dtype:
            self.pool._buffer.normal_()
        else:  # N(0, 1) values in the cache's format (float8 has no normal_)
            self.pool._buffer.copy_(torch.randn(self.pool._buffer.shape, device=self.dev).to(kv_dtype))
        self.table = torch.zeros(MAX_REQS, MAX_SEQ, dtype=torch.int32, device=self.dev)
        self.ctx = AttentionContext(
            heads, kv_heads, head_dim, page_size, self.pool, self.table, MAX_REQS, MAX_SEQ, dtype, self.dev
        )
        self.backend = build_xqa(self.ctx)
        self.ref = TorchAttnBackend(self.ctx)

    def batch(self, lens: list[int]) -> Batch:
        """A decode batch: request ``i`` in row ``i`` has ``lens[i]`` tokens, the last one new."""
        free = list(range(1, self.num_pages))
        self.rng.shuffle(free)
        reqs, locs = [], []
        for row, n in enumerate(lens):
            pages = torch.tensor([free.pop() for _ in range(-(-n // self.ps))])
            slots = (pages.view(-1, 1) * self.ps + torch.arange(self.ps)).view(-1).to(torch.int32)
            self.table[row, : slots.numel()] = slots.to(self.dev)
            req = Req(rid=row, input_ids=[0] * n, params=SamplingParams(), max_new_tokens=1)
            req.table_idx, req.cached_len, req.device_len = row, n - 1, n
            reqs.append(req)
            locs.append(slots[n - 1 : n].long())
        return Batch(reqs, "decode", out_loc=torch.cat(locs).to(self.dev), sample_mask=[True] * len(reqs))

    def qkv(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.ctx
        shape = [(tokens, h * c.head_dim) for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads)]
        q, k, v = (torch.randn(s, device=self.dev, dtype=c.dtype) for s in shape)
        return q, k, v

    def reference(self, batch: Batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        ref_batch = Batch(batch.reqs, "decode", out_loc=batch.out_loc, sample_mask=batch.sample_mask)
        self.ref.prepare_metadata(ref_batch)
        return self.ref.forward(q, k, v, layer, ref_batch)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


# (query heads, KV heads, head_dim, page size, dtype, PDL): every shape is in gpu/prebuild.py.
SHAPES = [
    (16, 8, 128, 16, torch.bfloat16, None),  # Qwen3-0.6B
    (16, 8, 128, 16, torch.bfloat16, False),
    (16, 4, 128, 16, torch.bfloat16, None),
    (8, 8, 128, 16, torch.bfloat16, None),
    (16, 8, 128, 64, torch.bfloat16, None),
    (16, 8, 128, 16, torch.float16, None),
    (16, 8, 256, 16, torch.bfloat16, None),
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "page_size", "dtype", "pdl"), SHAPES)
@pytest.mark.parametrize("lens", ["mixed", "batch64"])
@marks(*XQA)
def test_xqa_decode_matches_torch(
    heads: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, pdl: bool | None, lens: str
) -> None:
    s = Setup(heads, kv_heads, head_dim, page_size, dtype, seed=head_dim + page_size + heads)
    s.backend.enable_pdl = pdl
    sizes = (
        [1, 15, 16, 17, 64, 300, 511, 1000, 2048] if lens == "mixed" else [s.rng.randint(550, 650) for _ in range(64)]
    )
    batch = s.batch(sizes)
    q, k, v = s.qkv(len(sizes))
    s.backend.prepare_metadata(batch)
    out = s.backend.forward(q, k, v, 1, batch)
    poisoned = torch.full((len(sizes), heads, head_dim), float("nan"), dtype=dtype, device=s.dev)
    again = batch.attn_metadata.run(
        query=q.view(-1, heads, head_dim), kv_cache=(s.pool.k_cache(1), s.pool.v_cache(1)), out=poisoned
    )
    assert not torch.isnan(again).any(), "XQA left output elements unwritten"
    assert rel_err(again.view_as(out), out) < 1e-3
    err = rel_err(out, s.reference(batch, q, k, v, 1))
    assert err < 1e-2, f"relative error {err:.2e} against the torch backend"


@pytest.mark.parametrize("lens", ["mixed", "batch64"])
@marks(*XQA)
def test_xqa_fp8_decode_matches_torch(lens: str) -> None:
    """The 8B shapes (32 query heads, 8 KV heads, head_dim 128) over an FP8 cache with per-layer scales, against
    the torch backend reading the same cache. The bound, 10 % of the output's norm, allows for rounding the
    query and the probabilities to e4m3 (up to 6 % per value, 3 mantissa bits) on N(0, 1) data; a dropped k or
    v scale (the kit's KV_TEST_SCALES) is off by 50 % or more."""
    s = Setup(32, 8, 128, 16, torch.bfloat16, seed=3, kv_dtype=torch.float8_e4m3fn)
    sizes = [1, 15, 16, 17, 64, 300, 511, 1000, 2048]
    if lens == "batch64":
        sizes = [s.rng.randint(550, 650) for _ in range(64)]
    batch = s.batch(sizes)
    q, k, v = s.qkv(len(sizes))
    for layer in (0, 1):  # the two layers' scales differ
        s.backend.prepare_metadata(batch)
        out = s.backend.forward(q, k, v, layer, batch)
        assert not torch.isnan(out).any()
        err = rel_err(out, s.reference(batch, q, k, v, layer))
        assert err < 0.1, f"layer {layer}: relative error {err:.2e} against the torch backend over the FP8 cache"
        print(f"RESULT xqa fp8 {lens} layer {layer}: relative error {err:.2e}")


@marks(*XQA)
def test_xqa_decode_graph_replay_matches_torch() -> None:
    """Capture decode at batch sizes 4 and 8; replay with 5 and then 1 real requests (the rest padding)."""
    s = Setup(16, 8, 128, 16, torch.bfloat16, seed=7)
    c = s.ctx
    s.backend.init_capture_graph(MAX_SEQ, [4, 8])
    graphs, outs, statics = {}, {}, {}
    for bs in (8, 4):
        q = torch.zeros(bs, c.num_qo_heads * c.head_dim, dtype=c.dtype, device=s.dev)
        k = torch.zeros(bs, c.num_kv_heads * c.head_dim, dtype=c.dtype, device=s.dev)
        v, loc = torch.zeros_like(k), torch.zeros(bs, dtype=torch.int64, device=s.dev)
        static = Batch([], "decode", out_loc=loc, padded_size=bs)
        s.backend.prepare_for_capture(static)
        s.backend.forward(q, k, v, 0, static)  # warm-up outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs[bs] = s.backend.forward(q, k, v, 0, static)
        graphs[bs], statics[bs] = graph, (q, k, v, loc)
    for bs, lens in ((8, [s.rng.randint(1, MAX_SEQ) for _ in range(5)]), (4, [1500]), (8, [3, 2000, 17, 64, 900])):
        batch = s.batch(lens)
        batch.padded_size = bs
        q, k, v = s.qkv(len(lens))
        sq, sk, sv, sloc = statics[bs]
        n = len(lens)
        sq[:n], sk[:n], sv[:n] = q, k, v
        sloc.zero_()
        sloc[:n] = batch.out_loc
        s.backend.prepare_for_replay(batch)
        outs[bs].fill_(float("nan"))
        graphs[bs].replay()
        got = outs[bs][:n].clone()
        assert not torch.isnan(got).any(), f"bs {bs}, lens {lens}: unwritten output"
        err = rel_err(got, s.reference(batch, q, k, v, 0))
        assert err < 1e-2, f"bs {bs}, lens {lens}: relative error {err:.2e}"


# ------------------------------------------------------------------ whole models
MODELS = {
    "Qwen3ForCausalLM": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128},
    "LlamaForCausalLM": {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64},
}
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("minisgl_plugin_llama", reason="the tiny models come from the llama-family plugin")
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(request.param, path, max_position_embeddings=2048, **MODELS[request.param])
    return path


def _generate(path: Path, attn: str, logprobs: int | None = None, **kw: object) -> tuple[list[list[int]], list, LLM]:
    """Greedy tokens (and, with ``logprobs``, the top alternatives at each step: the scheduler
    then runs in lock-step, so only the reference and the FP8 test's second run ask for them)."""
    prompts = random_prompts([5, 17, 300, 64, 9, 128, 33, 250, 1, 700, 48, 90], 512, seed=11)
    llm = LLM(
        str(path), device="cuda", dtype="bfloat16", attention_backend=attn, page_size=16,
        max_running_requests=16, chunked_prefill_size=256, **kw,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.check_accounting()
    return [o.token_ids for o in outs], [o.logprobs for o in outs], llm


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[list[list[int]], list]:
    tokens, logprobs, llm = _generate(model_dir, "torch", logprobs=5, overlap_schedule=False)
    llm.close()
    return tokens, logprobs


CASES = [
    ("trtllm-xqa", True, True),
    ("trtllm-xqa", False, False),
    ("torch,trtllm-xqa", True, True),
    ("flashinfer,trtllm-xqa", True, True),
]


@pytest.mark.parametrize(("attn", "graphs", "overlap"), CASES)
@marks(*XQA)
def test_greedy_decoding_agrees_with_torch(
    model_dir: Path, reference: tuple[list[list[int]], list], attn: str, graphs: bool, overlap: bool
) -> None:
    if attn.startswith("flashinfer"):
        if importlib.util.find_spec("minisgl_plugin_flashinfer") is None:
            pytest.skip("the flashinfer plugin is not installed")
        if "Llama" in model_dir.name:
            pytest.skip("one model is enough for the hybrid (saves FlashInfer compiling its head_dim 64 prefill)")
    from minisgl_plugin_trtllm.backend import TrtllmAttnBackend

    tokens, _, llm = _generate(model_dir, attn, cuda_graph_max_bs=16 if graphs else 0, overlap_schedule=overlap)
    attn_backend = llm.engine.attn
    decode = attn_backend.decode if isinstance(attn_backend, HybridAttnBackend) else attn_backend
    assert isinstance(decode, TrtllmAttnBackend) and decode.decode_kernel == "xqa"
    assert (llm.engine.graphs is not None) == graphs
    assert llm.scheduler.overlap == overlap
    llm.close()
    want, ref_logprobs = reference
    same = check_divergences(tokens, want, ref_logprobs, attn, TIE_NATS)
    print(f"RESULT {model_dir.name} {attn} graphs={graphs}: {same}/{len(want)} sequences identical to torch")
    assert same >= len(want) // 2, f"{attn}: only {same} of {len(want)} sequences equal the reference"


@pytest.mark.parametrize("attn", ["flashinfer,trtllm-xqa", "trtllm-xqa", "auto"])
@marks(*XQA)
def test_greedy_decoding_over_an_fp8_cache_agrees_with_torch(model_dir: Path, attn: str) -> None:
    """``--kv-cache-dtype fp8_e4m3``: XQA's FP8 decode under CUDA graphs and overlap against the torch backend
    over the same FP8 cache; ``--attn auto`` prefills with FlashInfer and decodes with XQA."""
    if "Llama" in model_dir.name:
        pytest.skip("one model is enough (each KV dtype is another XQA build)")
    if attn != "trtllm-xqa" and importlib.util.find_spec("minisgl_plugin_flashinfer") is None:
        pytest.skip("the flashinfer plugin is not installed")
    from minisgl_plugin_trtllm.backend import TrtllmAttnBackend

    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    want, ref_logprobs, ref = _generate(model_dir, "torch", logprobs=5, overlap_schedule=False, **fp8)
    ref.close()
    # Overlapped (tokens only), then in lock-step with the log-probabilities the second check compares;
    # one engine at a time (each sizes its KV pool from the free GPU memory).
    runs = []
    for top in (None, 5):
        tokens, scores, llm = _generate(model_dir, attn, logprobs=top, cuda_graph_max_bs=16, **fp8)
        attn_backend = llm.engine.attn
        decode = attn_backend.decode if isinstance(attn_backend, HybridAttnBackend) else attn_backend
        assert isinstance(decode, TrtllmAttnBackend) and decode.ctx.kv_pool.layout.dtype == torch.float8_e4m3fn
        assert llm.engine.graphs is not None and llm.scheduler.overlap
        if attn == "auto":
            assert [spec.name for spec in llm.engine.attn_specs] == ["flashinfer", "trtllm-xqa"]
        llm.close()
        runs.append((tokens, scores))
    (tokens, _), (scored, logprobs) = runs
    same = check_divergences(tokens, want, ref_logprobs, attn, FP8_TIE_NATS)
    check_divergences(scored, want, ref_logprobs, attn, FP8_TIE_NATS)
    p90 = check_logprobs(scored, logprobs, want, ref_logprobs, attn, FP8_LOGPROB_P90_NATS)
    print(f"RESULT {model_dir.name} {attn} fp8 KV: {same}/{len(want)} sequences identical to torch, "
          f"log-probabilities within {p90:.3f} nats at the 90th percentile")  # fmt: skip


# ------------------------------------------------------------------ refusing trtllm-gen
@marks(*NOT_TRTLLM_GEN)
def test_trtllm_is_refused_with_its_reason_off_blackwell(tmp_path: Path) -> None:
    from minisgl_plugin_trtllm.backend import build_trtllm_gen

    major, minor = CAPABILITY
    layout = KVLayout(1, 4, 16, 8, 128, torch.bfloat16, torch.device("cuda"))
    ctx = AttentionContext(16, 8, 128, 16, MHAKVPool(layout), torch.zeros(2, 64, dtype=torch.int32, device="cuda"),
                           2, 64, torch.bfloat16, torch.device("cuda"))  # fmt: skip
    with pytest.raises(ValueError, match=rf"GPU is {major}\.{minor}"):
        build_trtllm_gen(ctx)
    listed = subprocess.run(
        [sys.executable, "-m", "minisgl", "plugins", "--device", "cuda"], capture_output=True, text=True, timeout=120
    )
    assert "attention trtllm: unsupported on cuda: TensorRT-LLM-gen" in listed.stdout, listed.stdout + listed.stderr
    print("RESULT minisgl plugins --device cuda:\n" + listed.stdout)
    (tmp_path / "config.json").write_text("{}")
    t0 = time.perf_counter()
    served = subprocess.run(
        [sys.executable, "-m", "minisgl", "serve", "--model", str(tmp_path), "--attn", "trtllm", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.perf_counter() - t0
    assert served.returncode == 2, served.stdout + served.stderr
    assert "--attn: attention backend 'trtllm' does not support device 'cuda'" in served.stderr
    assert f"GPU is {major}.{minor}" in served.stderr
    print(f"RESULT minisgl serve --attn trtllm refused in {took:.1f}s: {served.stderr.strip()}")
