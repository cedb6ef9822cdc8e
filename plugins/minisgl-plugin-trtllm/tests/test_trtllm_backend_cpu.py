"""The backend's own logic on CPU, with FlashInfer's two entry points emulated (trtllm_emulation.py).

Everything but the CUDA kernels runs here: block tables gathered from the token
page table, per-batch metadata, the torch fallback for prefill, CUDA-graph
buffers refreshed in place, the factories' shape checks, and a whole engine.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_agreement import FP8_LOGPROB_P90_NATS, FP8_TIE_NATS, check_divergences, check_logprobs
from minisgl_plugin_trtllm import backend as backend_mod
from minisgl_plugin_trtllm.backend import TrtllmAttnBackend, TrtllmKernels, TrtllmMetadata, build_trtllm_gen, build_xqa
from trtllm_emulation import EmulatedKernels

from minisgl import LLM, SamplingParams
from minisgl.attention import AttentionContext, HybridAttnBackend, TorchAttnBackend
from minisgl.core import Batch, Req
from minisgl.kvcache import KVLayout, MHAKVPool
from minisgl.plugins import AttentionBackendSpec, ModelSpec, PluginSource, hookimpl, load_plugins
from minisgl.testing.attention import AttentionBackendConformance
from minisgl.testing.models import random_prompts, save_tiny_model
from minisgl.testing.registry import CoreBlocksLM

SMALL_WORKSPACE = 1 << 16


def emulated(decode: str, with_context: bool, kernels: EmulatedKernels | None = None) -> Any:
    """A factory(ctx) for the backend over emulated kernels."""
    emu = kernels or EmulatedKernels()
    k = TrtllmKernels(
        emu.trtllm_batch_decode_with_kv_cache, emu.trtllm_batch_context_with_kv_cache if with_context else None
    )
    return lambda ctx: TrtllmAttnBackend(ctx, k, decode=decode, workspace_bytes=SMALL_WORKSPACE)  # type: ignore[arg-type]


class TestEmulatedTrtllmGen(AttentionBackendConformance):
    """Context kernel for prefill, trtllm-gen decode: block tables for both page sizes and every GQA ratio
    of the kit (the head size only changes the emulated arithmetic; the GPU tests cover it)."""

    backend = staticmethod(emulated("trtllm-gen", with_context=True))
    head_dims = (64,)


class TestEmulatedXqa(AttentionBackendConformance):
    """XQA decode, prefill through the torch fallback."""

    backend = staticmethod(emulated("xqa", with_context=False))
    gqa_ratios = (2,)
    head_dims = (64,)


class TestEmulatedXqaFP8KV(AttentionBackendConformance):
    """XQA decode over an FP8 KV cache whose layers have k/v scales other than 1.0: each layer's call carries
    ``softmax_scale * k_scale`` and ``v_scale``; prefill through the torch fallback, which de-quantizes."""

    backend = staticmethod(emulated("xqa", with_context=False))
    kv_cache_dtype = "fp8_e4m3"
    gqa_ratios = (2,)
    head_dims = (64,)


# ------------------------------------------------------------------ a hand-made pool and table
MAX_REQS, MAX_SEQ = 8, 256


class Setup:
    """A pool with random contents, a page table with randomly placed pages, the backend and the reference."""

    def __init__(self, page_size: int, decode: str = "xqa", with_context: bool = False, seed: int = 0):
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.ps = page_size
        self.num_pages = MAX_REQS * MAX_SEQ // page_size + 1
        layout = KVLayout(2, self.num_pages, page_size, 2, 32, torch.float32, torch.device("cpu"))
        self.pool = MHAKVPool(layout)
        self.pool._buffer.normal_()
        self.table = torch.zeros(MAX_REQS, MAX_SEQ, dtype=torch.int32)
        self.ctx = AttentionContext(4, 2, 32, page_size, self.pool, self.table, MAX_REQS, MAX_SEQ, torch.float32,
                                    torch.device("cpu"))  # fmt: skip
        self.kernels = EmulatedKernels()
        self.backend = emulated(decode, with_context, self.kernels)(self.ctx)
        self.ref = TorchAttnBackend(replace(self.ctx))

    def batch(self, phase: str, specs: list[tuple[int, int]]) -> Batch:
        """``specs``: (cached, new) tokens per request, rows in order; pages drawn at random."""
        free = list(range(1, self.num_pages))
        self.rng.shuffle(free)
        reqs, locs = [], []
        for row, (cached, new) in enumerate(specs):
            total = cached + new
            pages = [free.pop() for _ in range(-(-total // self.ps))]
            slots = (torch.tensor(pages).view(-1, 1) * self.ps + torch.arange(self.ps)).view(-1).to(torch.int32)
            self.table[row] = -7  # stale garbage past the request's pages must never be read
            self.table[row, : slots.numel()] = slots
            req = Req(rid=row, input_ids=[0] * total, params=SamplingParams(), max_new_tokens=1)
            req.table_idx, req.cached_len, req.device_len = row, cached, total
            reqs.append(req)
            locs.append(slots[cached:total].long())
        return Batch(reqs, phase, out_loc=torch.cat(locs), sample_mask=[True] * len(reqs))

    def qkv(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.randn(tokens, 4 * 32), torch.randn(tokens, 2 * 32), torch.randn(tokens, 2 * 32)

    def reference(self, batch: Batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ref_batch = Batch(batch.reqs, batch.phase, out_loc=batch.out_loc, sample_mask=batch.sample_mask)
        self.ref.prepare_metadata(ref_batch)
        return self.ref.forward(q, k, v, 0, ref_batch)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_block_tables_hold_each_request_pages_then_the_scratch_page(page_size: int) -> None:
    s = Setup(page_size)
    lens = [1, page_size, page_size + 1, 3 * page_size + 2, 50]
    batch = s.batch("decode", [(n - 1, 1) for n in lens])
    rows = torch.arange(len(lens), dtype=torch.int32)
    width = -(-max(lens) // page_size) + 2
    tables = s.backend.block_tables(rows, torch.tensor(lens, dtype=torch.int32), width)
    assert tables.dtype == torch.int32 and tables.shape == (len(lens), width) and tables.is_contiguous()
    for i, (req, n) in enumerate(zip(batch.reqs, lens, strict=True)):
        count = -(-n // page_size)
        want = (s.table[req.table_idx, : count * page_size : page_size] // page_size).tolist()
        assert tables[i, :count].tolist() == want
        assert all(p > 0 for p in want)
        assert tables[i, count:].tolist() == [0] * (width - count)


@pytest.mark.parametrize(("decode", "with_context"), [("xqa", False), ("trtllm-gen", True)])
def test_decode_and_prefill_metadata_bind_the_right_kernel(decode: str, with_context: bool) -> None:
    s = Setup(16, decode, with_context)
    batch = s.batch("decode", [(c, 1) for c in (0, 15, 16, 40, 200)])
    s.backend.prepare_metadata(batch)
    meta = batch.attn_metadata
    assert isinstance(meta, TrtllmMetadata)
    assert meta.seq_lens.tolist() == [1, 16, 17, 41, 201]
    assert meta.block_tables.shape == (5, 13)  # ceil(201 / 16) pages: as wide as the longest request
    assert meta.run.keywords["backend"] == decode and meta.run.keywords["kv_layout"] == "NHD"
    assert meta.run.keywords["bmm1_scale"] == pytest.approx(32**-0.5)
    q, k, v = s.qkv(5)
    out = s.backend.forward(q, k, v, 0, batch)
    assert torch.allclose(out, s.reference(batch, q, k, v), atol=1e-5)
    assert s.kernels.calls == {decode: 1}

    prefill = s.batch("prefill", [(0, 7), (16, 9), (33, 1)])
    s.backend.prepare_metadata(prefill)
    if with_context:
        meta = prefill.attn_metadata
        assert isinstance(meta, TrtllmMetadata)
        assert meta.run.keywords["cum_seq_lens_q"].tolist() == [0, 7, 16, 17]
        assert meta.run.keywords["cum_seq_lens_kv"].tolist() == [0, 7, 32, 66]
        assert (meta.run.keywords["max_q_len"], meta.run.keywords["max_kv_len"]) == (9, 34)
    else:
        assert not isinstance(prefill.attn_metadata, TrtllmMetadata)  # the torch fallback's own metadata
    q, k, v = s.qkv(17)
    out = s.backend.forward(q, k, v, 0, prefill)
    assert torch.allclose(out, s.reference(prefill, q, k, v), atol=1e-5)
    assert s.kernels.calls.get("context", 0) == (1 if with_context else 0)


def test_torch_fallback_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    s = Setup(16)
    with caplog.at_level("WARNING", logger="minisgl_plugin_trtllm.backend"):
        for _ in range(3):
            s.backend.prepare_metadata(s.batch("prefill", [(0, 5)]))
    assert caplog.text.count("--attn flashinfer,trtllm-xqa") == 1


@pytest.mark.parametrize(("decode", "page_size"), [("xqa", 16), ("trtllm-gen", 16), ("xqa", 1)])
def test_graph_buffers_are_refreshed_in_place_for_replay(decode: str, page_size: int) -> None:
    """Capture-time metadata (the call a CUDA graph would bake in) stays valid across replays:
    only the static tables and lengths change, padded rows point at the scratch page."""
    s = Setup(page_size, decode, decode == "trtllm-gen", seed=3)
    s.backend.init_capture_graph(MAX_SEQ, [1, 2, 4, 8])
    width = -(-MAX_SEQ // page_size)
    static = Batch([], "decode", out_loc=torch.zeros(8, dtype=torch.int64), padded_size=8)
    s.backend.prepare_for_capture(static)
    captured = static.attn_metadata
    assert isinstance(captured, TrtllmMetadata)
    assert captured.block_tables.shape == (8, width) and captured.seq_lens.tolist() == [1] * 8
    assert captured.run.keywords["max_seq_len"] == width * page_size
    q8, k8, v8 = s.qkv(8)
    s.backend.forward(q8, k8, v8, 0, static)  # what capture runs: padding reads and writes page 0 only
    for round_ in range(2):
        lens = [s.rng.randint(1, MAX_SEQ) for _ in range(5)]
        batch = s.batch("decode", [(n - 1, 1) for n in lens])
        batch.padded_size = 8
        s.backend.prepare_for_replay(batch)
        assert batch.attn_metadata is captured
        assert captured.seq_lens.tolist() == lens + [1, 1, 1]
        assert captured.block_tables[5:].count_nonzero() == 0
        assert torch.equal(
            captured.block_tables[:5], s.backend.block_tables(torch.arange(5, dtype=torch.int32),
                                                              torch.tensor(lens, dtype=torch.int32), width)
        )  # fmt: skip
        q, k, v = s.qkv(5)
        q8[:5], k8[:5], v8[:5] = q, k, v
        assert batch.out_loc is not None
        static.out_loc[:5], static.out_loc[5:] = batch.out_loc, 0  # type: ignore[index]
        out = s.backend.forward(q8, k8, v8, 0, static)[:5]  # the "replay": capture-time metadata
        want = s.reference(batch, q, k, v)
        assert torch.allclose(out, want, atol=1e-5), f"round {round_}"


# ------------------------------------------------------------------ factories
def _cuda_ctx(**overrides: Any) -> AttentionContext:
    """A context that claims a CUDA device (the checks only read shapes and dtypes)."""
    shape = {"heads": 16, "kv_heads": 8, "head_dim": 128, "page_size": 16, "dtype": torch.bfloat16, **overrides}
    cpu = torch.device("cpu")
    kv_dtype = shape.get("kv_dtype", shape["dtype"])
    layout = KVLayout(1, 4, shape["page_size"], shape["kv_heads"], shape["head_dim"], kv_dtype, cpu)
    return AttentionContext(
        shape["heads"], shape["kv_heads"], shape["head_dim"], shape["page_size"], MHAKVPool(layout),
        torch.zeros(2, 64, dtype=torch.int32), 2, 64, shape["dtype"], torch.device("cuda"),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"head_dim": 96}, "head_dim 96 is not supported"),
        ({"page_size": 1}, "page size 1 is not supported"),
        ({"dtype": torch.float32}, "dtype torch.float32"),
        ({"heads": 64, "kv_heads": 2}, "32 query heads per KV head"),
        ({"kv_dtype": torch.float16}, "a torch.float16 KV pool is not supported"),
    ],
)
def test_xqa_factory_rejects_shapes_it_cannot_run(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_xqa(_cuda_ctx(**overrides))


def test_xqa_factory_builds_its_module_and_turns_a_failed_build_into_a_value_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The module is built by the factory (a failure there lets ``--attn auto`` move on) with the arguments
    FlashInfer's own call uses."""
    import sys
    import types

    built: list[tuple[Any, ...]] = []

    def get_xqa_module(*args: Any) -> None:
        built.append(args)
        if len(built) > 1:
            raise RuntimeError("Ninja build failed: nvcc not found")

    emu = EmulatedKernels()
    fake = {"flashinfer": types.ModuleType("flashinfer"), "flashinfer.xqa": types.ModuleType("flashinfer.xqa"),
            "flashinfer.decode": types.ModuleType("flashinfer.decode")}  # fmt: skip
    fake["flashinfer.xqa"].get_xqa_module = get_xqa_module  # type: ignore[attr-defined]
    fake["flashinfer.decode"].trtllm_batch_decode_with_kv_cache = emu.trtllm_batch_decode_with_kv_cache  # type: ignore[attr-defined]
    for name, module in fake.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(backend_mod.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    # The backend itself would allocate its workspace on the GPU the context names.
    monkeypatch.setattr(backend_mod, "TrtllmAttnBackend", lambda ctx, kernels, decode: ("backend", decode))
    ctx = _cuda_ctx(kv_dtype=torch.float8_e4m3fn)
    assert build_xqa(ctx) == ("backend", "xqa")
    assert built == [(torch.bfloat16, torch.float8_e4m3fn, 16, 128, 2, False, torch.bfloat16)]
    with pytest.raises(ValueError, match=r"^trtllm-xqa backend: FlashInfer could not build its XQA module .*nvcc"):
        build_xqa(ctx)


def test_an_fp8_pool_passes_the_xqa_check_and_not_trtllm_gen() -> None:
    fp8 = _cuda_ctx(kv_dtype=torch.float8_e4m3fn)
    backend_mod._check_shape(fp8, "trtllm-xqa", backend_mod.XQA_PAGE_SIZES, fp8_kv=True)
    with pytest.raises(ValueError, match=r"^trtllm backend: .*float8_e4m3fn KV pool .* of the model dtype\)"):
        build_trtllm_gen(fp8)


def test_each_layer_passes_its_kv_scales_to_the_kernel() -> None:
    """The scores' scale folds in the layer's k_scale, the output's is its v_scale; a 16-bit pool passes none."""
    cpu = torch.device("cpu")
    layout = KVLayout(2, 9, 16, 2, 32, torch.float8_e4m3fn, cpu, k_scales=(0.5, 2.0), v_scales=(4.0, 0.25))
    table = torch.zeros(2, 64, dtype=torch.int32)
    ctx = AttentionContext(4, 2, 32, 16, MHAKVPool(layout), table, 2, 64, torch.float32, cpu)
    backend = emulated("xqa", with_context=False)(ctx)
    scale = ctx.scale
    assert backend._layer_scales == [
        {"bmm1_scale": scale * 0.5, "bmm2_scale": 4.0},
        {"bmm1_scale": scale * 2.0, "bmm2_scale": 0.25},
    ]
    plain = replace(ctx, kv_pool=MHAKVPool(replace(layout, dtype=torch.float32, k_scales=(), v_scales=())))
    assert emulated("xqa", with_context=False)(plain)._layer_scales == []


def test_factories_reject_cpu_and_check_the_gpu_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = replace(_cuda_ctx(), device=torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA device, got 'cpu'; use --attn torch"):
        build_xqa(cpu)
    with pytest.raises(ValueError, match="page size 128 is not supported"):
        build_trtllm_gen(_cuda_ctx(page_size=128))  # XQA takes 128-token pages, trtllm-gen does not
    monkeypatch.setattr(backend_mod.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match=r"^trtllm backend: TensorRT-LLM-gen .* GPU is 9\.0"):
        build_trtllm_gen(_cuda_ctx())
    monkeypatch.setattr(backend_mod.torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(ValueError, match=r"^trtllm-xqa backend: TensorRT-LLM's XQA .* GPU is 8\.6"):
        build_xqa(_cuda_ctx())


# ------------------------------------------------------------------ a whole engine
class EmulatedPlugin:
    """The test model and the backend over emulated kernels, as installed plugins would provide them
    (``xqa_kernels``: the emulation ``emu-xqa`` calls, a fresh one by default)."""

    def __init__(self, xqa_kernels: EmulatedKernels | None = None) -> None:
        self.xqa_kernels = xqa_kernels

    @hookimpl
    def minisgl_models(self) -> list[ModelSpec]:
        return [ModelSpec(name="LlamaForCausalLM", factory=CoreBlocksLM)]

    @hookimpl
    def minisgl_attention_backends(self) -> list[AttentionBackendSpec]:
        return [
            AttentionBackendSpec(name="emu-gen", factory=emulated("trtllm-gen", with_context=True)),
            AttentionBackendSpec(
                name="emu-xqa", factory=emulated("xqa", False, self.xqa_kernels), kv_cache_dtypes=("fp8_e4m3",)
            ),
        ]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(
        "LlamaForCausalLM", path, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32
    )
    return path


def _kernel_calls(attn: Any) -> dict[str, int]:
    backend = attn.decode if isinstance(attn, HybridAttnBackend) else attn
    if not isinstance(backend, TrtllmAttnBackend):
        return {}
    return dict(backend.kernels.decode.__self__.calls)  # type: ignore[attr-defined]


def test_engine_greedy_tokens_equal_the_torch_backend(tiny_model: Path) -> None:
    """Chunked prefill, prefix-cache hits and decode through the engine's own batches."""
    reg = load_plugins(only=["builtin", "emu"], extra=[PluginSource("emu", EmulatedPlugin())], environ={})
    shared = random_prompts([40], 256, seed=1)[0]
    prompts = random_prompts([5, 70, 1, 33, 18], 256, seed=2) + [shared + [7, 8], shared + [9]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs, calls = {}, {}
    for attn in ("torch", "emu-gen", "emu-xqa", "torch,emu-xqa"):
        with LLM(str(tiny_model), registry=reg, attention_backend=attn, page_size=16, chunked_prefill_size=32,
                 max_running_requests=4) as llm:  # fmt: skip
            outputs[attn] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            llm.check_accounting()
            calls[attn] = _kernel_calls(llm.engine.attn)
    assert calls["emu-gen"].keys() == {"context", "trtllm-gen"}
    assert calls["emu-xqa"].keys() == calls["torch,emu-xqa"].keys() == {"xqa"}
    for attn in ("emu-gen", "emu-xqa", "torch,emu-xqa"):
        assert outputs[attn] == outputs["torch"], attn


def test_engine_over_an_fp8_cache_equals_the_torch_backend(tiny_model: Path) -> None:
    """``--kv-cache-dtype fp8_e4m3``: XQA's decode (emulated) and the torch reference read the same FP8 cache."""
    reg = load_plugins(only=["builtin", "emu"], extra=[PluginSource("emu", EmulatedPlugin())], environ={})
    prompts = random_prompts([5, 70, 1, 33], 256, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs, calls = {}, {}
    for attn in ("torch", "emu-xqa", "torch,emu-xqa"):
        with LLM(str(tiny_model), registry=reg, attention_backend=attn, page_size=16, chunked_prefill_size=32,
                 max_running_requests=4, kv_cache_dtype="fp8_e4m3") as llm:  # fmt: skip
            assert llm.engine.kv_pool.layout.dtype == torch.float8_e4m3fn
            outputs[attn] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            llm.check_accounting()
            calls[attn] = _kernel_calls(llm.engine.attn)
    assert calls["emu-xqa"].keys() == calls["torch,emu-xqa"].keys() == {"xqa"}
    assert outputs["emu-xqa"] == outputs["torch"] and outputs["torch,emu-xqa"] == outputs["torch"]


# ------------------------------------------------------------------ the GPU test's FP8 agreement check
# test_trtllm_gpu.py's greedy test over an FP8 cache, on a model of the same shape and the same prompts.
# There XQA rounds the query and the probabilities to e4m3, which the torch reference does not; here the
# emulated kernels round them too, and the check must let that pass and stop a decode with a fault.
FP8_CHECK_SHAPE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128}
FP8_CHECK_PROMPTS = [5, 17, 300, 64, 9, 128, 33, 250, 1, 700, 48, 90]


class FaultyKernels(EmulatedKernels):
    """XQA's FP8 rounding, and optionally a fault in the decode call: ``softmax-scale`` (scores 10 % too
    large), ``newest-key`` (one token short: the step's own K/V unread) or ``v-scale`` (output 1.5x)."""

    def __init__(self, fault: str | None) -> None:
        super().__init__(fp8_rounding=True)
        self.fault = fault

    def trtllm_batch_decode_with_kv_cache(  # type: ignore[override]
        self, query: torch.Tensor, kv_cache: Any, workspace_buffer: torch.Tensor, block_tables: torch.Tensor,
        seq_lens: torch.Tensor, max_seq_len: int, bmm1_scale: Any = 1.0, bmm2_scale: Any = 1.0, **kw: Any,
    ) -> torch.Tensor:  # fmt: skip
        if self.fault == "softmax-scale":
            bmm1_scale = float(bmm1_scale) * 1.1
        elif self.fault == "newest-key":
            seq_lens = (seq_lens - 1).clamp(min=1)
        elif self.fault == "v-scale":
            bmm2_scale = float(bmm2_scale) * 1.5
        return super().trtllm_batch_decode_with_kv_cache(
            query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len, bmm1_scale, bmm2_scale, **kw
        )


def _fp8_greedy(path: Path, attn: str, fault: str | None) -> tuple[list[list[int]], list]:
    reg = load_plugins(
        only=["builtin", "emu"], extra=[PluginSource("emu", EmulatedPlugin(FaultyKernels(fault)))], environ={}
    )
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    with LLM(str(path), registry=reg, dtype="bfloat16", attention_backend=attn, page_size=16, max_running_requests=16,
             chunked_prefill_size=256, kv_cache_dtype="fp8_e4m3") as llm:  # fmt: skip
        outs = llm.generate(random_prompts(FP8_CHECK_PROMPTS, 512, seed=11), params, use_tqdm=False)
        llm.check_accounting()
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


@pytest.fixture(scope="module")
def fp8_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list]:
    path = tmp_path_factory.mktemp("fp8-check")
    save_tiny_model("LlamaForCausalLM", path, max_position_embeddings=2048, **FP8_CHECK_SHAPE)
    return (path, *_fp8_greedy(path, "torch", None))


@pytest.mark.parametrize("fault", [None, "softmax-scale", "newest-key", "v-scale"])
def test_the_fp8_greedy_check_passes_xqa_rounding_and_stops_faults(
    fp8_reference: tuple[Path, list[list[int]], list], fault: str | None
) -> None:
    path, want, ref_logprobs = fp8_reference
    tokens, logprobs = _fp8_greedy(path, "emu-xqa", fault)

    def check() -> None:
        check_divergences(tokens, want, ref_logprobs, "emu-xqa", FP8_TIE_NATS)
        check_logprobs(tokens, logprobs, want, ref_logprobs, "emu-xqa", FP8_LOGPROB_P90_NATS)

    if fault is None:
        assert tokens != want  # the rounding flips near-ties: what the check has to tolerate
        check()
    else:
        with pytest.raises(AssertionError):
            check()
