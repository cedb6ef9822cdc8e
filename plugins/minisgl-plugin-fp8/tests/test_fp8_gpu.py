"""The FP8 GEMM paths on CUDA against float32 references (skipped without a GPU with FP8 tensor cores).

Bounds, as relative Frobenius error ``||y - ref|| / ||ref||``:

- against ``x @ dequantize(W).T`` in float32 (activations exact): 0.08 for paths that quantize activations to
  FP8 (e4m3 keeps 3 mantissa bits: a rounding error of up to 1/16 per element, about 3-4 % RMS), 0.02 for the
  de-quantizing fallback (bf16 rounding of weights, activations and output);
- against the same product with activations quantized as the path quantizes them (:func:`reference_w8a8_linear`):
  0.02 (what is left is float32 accumulation order and the bf16 output).
"""

from __future__ import annotations

import importlib.util

import pytest
import test_fp8_conformance as cpu_kit  # the CPU conformance classes, rerun below on the GPU kernels
import torch
from minisgl_plugin_fp8 import kernels
from minisgl_plugin_fp8.config import ONLINE, FP8Scheme
from minisgl_plugin_fp8.method import W8A8_TILES, FP8Method
from minisgl_plugin_fp8.reference import (
    quantize_rows,
    quantize_token_groups,
    quantize_tokens,
    reference_linear,
    reference_w8a8_linear,
)
from minisgl_plugin_fp8.testing import quantize_weight

from minisgl.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

FP8_CAPABLE = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not FP8_CAPABLE, reason="needs a CUDA GPU with FP8 (sm89+)")]

SHAPES = [(1, 256, 512), (7, 192, 320), (64, 4096, 1536), (300, 1024, 4096)]  # (M, K, N); 192/320: partial blocks


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def _weights(k: int, n: int, layout: str) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """fp8 weight [n, k] on the GPU, its per-row scales as the method stores them, and block_k."""
    w = torch.randn(n, k) * k**-0.5
    parts, _ = quantize_weight(w, layout)
    q = parts["weight"].cuda()
    if layout == "fp8-block":
        scale = parts["weight_scale_inv"].repeat_interleave(128, 0)[:n].contiguous().cuda()
        return q, scale, 128
    q, scale = quantize_rows(w)
    return q.cuda(), scale.cuda(), None


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_per_channel(m: int, k: int, n: int, bias: bool) -> None:
    torch.manual_seed(0)
    w, scale, _ = _weights(k, n, "ct-channel")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    y = kernels.scaled_mm_linear(x, w, scale, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel_err(y, reference_linear(x, w, scale, None, b)) < 0.08
    assert rel_err(y, reference_w8a8_linear(x, w, scale, None, b)) < 0.02


W8A8_PATHS = ["scaled_mm_fast", "tensor_epi", "w8a8"] + ["w8a8:" + "x".join(map(str, t)) for t, _, _ in W8A8_TILES]


def _w8a8_gemm(path: str):  # noqa: ANN202
    """``(x, weight, scale, bias) -> y`` of a per-token x per-channel path (``w8a8:BMxBNxBKxWxS``: one tile)."""
    if path == "scaled_mm_fast":
        return lambda x, w, s, b: kernels.scaled_mm_linear(x, w, s, b, fast_accum=True)
    if path == "tensor_epi":
        one = torch.ones((), device="cuda")
        return lambda x, w, s, b: kernels.tensor_epilogue_linear(x, w, s, b, one)
    tile = tuple(int(v) for v in path.split(":")[1].split("x")) if ":" in path else None
    return lambda x, w, s, b: kernels.w8a8_linear(x, w, s, b, tile)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", W8A8_PATHS)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_per_channel_candidates(path: str, m: int, k: int, n: int, bias: bool) -> None:
    """Every GEMM the load-time tuning may choose for per-channel/per-tensor weights, tiles included, at
    shapes that fill no tile exactly (7 tokens, K = 192/320)."""
    torch.manual_seed(0)
    w, scale, _ = _weights(k, n, "ct-channel")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    y = _w8a8_gemm(path)(x, w, scale, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel_err(y, reference_linear(x, w, scale, None, b)) < 0.08
    # Fast accumulation keeps fewer bits in the tensor cores' accumulator than float32.
    assert rel_err(y, reference_w8a8_linear(x, w, scale, None, b)) < (0.03 if path != "w8a8" else 0.02)


@pytest.mark.parametrize("layout", ["ct-channel", "fp8-block"])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_weight_only_kernel(layout: str, m: int, k: int, n: int, bias: bool) -> None:
    """Weight-only FP8 keeps the activations: against the de-quantized weight it has only bf16 rounding."""
    torch.manual_seed(0)
    w, scale, block_k = _weights(k, n, layout)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    y = kernels.weight_only_linear(x, w, scale, block_k, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel_err(y, reference_linear(x, w, scale, block_k, b)) < 0.02


def _load_random_weights(layer: torch.nn.Module, method: FP8Method, scheme: str) -> None:
    """Random weights into ``layer`` as a checkpoint of ``scheme`` holds them (``block``: FP8 with block scales;
    ``online``: bf16, quantized by the method), then the method's after-loading step."""
    full = torch.randn(layer.out_features, layer.in_features) * layer.in_features**-0.5
    if scheme == "block":
        parts, _ = quantize_weight(full, "fp8-block")
        layer.weight.weight_loader(layer.weight, parts["weight"].cuda())
        scale = layer.weight_scale_inv
        scale.weight_loader(scale, parts["weight_scale_inv"].cuda())
    else:
        layer.weight.weight_loader(layer.weight, full.to(torch.bfloat16).cuda())
    method.process_weights_after_loading(layer)


@pytest.mark.parametrize("scheme", ["online", "block"])
def test_load_time_tuning_gives_each_shape_a_table_that_matches_the_reference(scheme: str) -> None:
    """The tuning times the candidates on the first layer of a shape, reuses the table for the next layer of
    that shape, and whatever it chose computes the product (eagerly and replayed in a CUDA graph)."""
    torch.manual_seed(0)
    method_scheme = FP8Scheme("fp8", "block", "weight_scale_inv", (128, 128)) if scheme == "block" else ONLINE
    method = FP8Method(method_scheme, torch.bfloat16, torch.device("cuda"))
    kw = {"dtype": torch.bfloat16, "device": torch.device("cuda"), "quant": method}
    layers = [ColumnParallelLinear(256, [512], **kw), ColumnParallelLinear(256, [512], **kw)]
    for layer in layers:
        _load_random_weights(layer, method, scheme)
    timed = [r for r in method.tuner.results if "ms" in r]
    assert {r["m"] for r in timed} == set(method.tuner.buckets), "every bucket timed at least its default"
    assert len({r["key"] for r in method.tuner.results}) == 1, "the second layer of the shape reused the table"
    names = {c.name for c in method.candidates(layers[0].fp8_path)}
    for layer in layers:
        assert set(layer.fp8_gemms.names) <= names
        scale = getattr(layer, method.scale_name)
        block_k = 128 if scheme == "block" else None
        for m in (1, 5, 48, 200, 700):
            x = torch.randn(m, layer.in_features, device="cuda", dtype=torch.bfloat16)
            ref = reference_linear(x, layer.weight, scale, block_k, None)
            assert rel_err(layer(x), ref) < 0.08, (m, layer.fp8_gemms.name_at(m))
            out = torch.empty(m, layer.out_features, device="cuda", dtype=torch.bfloat16)
            graph = torch.cuda.CUDAGraph()
            layer(x)  # warm (a Triton choice compiles outside the capture)
            with torch.cuda.graph(graph):
                out.copy_(layer(x))
            graph.replay()
            assert rel_err(out, ref) < 0.08, (m, layer.fp8_gemms.name_at(m))


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_triton_block_kernel(m: int, k: int, n: int, bias: bool) -> None:
    torch.manual_seed(0)
    w, scale, block_k = _weights(k, n, "fp8-block")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    y = kernels.block_linear(x, w, scale, 128, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel_err(y, reference_linear(x, w, scale, block_k, b)) < 0.08
    assert rel_err(y, reference_w8a8_linear(x, w, scale, block_k, b)) < 0.02


@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel"])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_dequant_fallback(layout: str, m: int, k: int, n: int) -> None:
    torch.manual_seed(0)
    w, scale, block_k = _weights(k, n, layout)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = kernels.dequant_linear(x, w, scale, block_k, None)
    assert rel_err(y, reference_linear(x, w, scale, block_k, None)) < 0.02


@pytest.mark.parametrize("group", [None, 128])
def test_fused_activation_quantization_matches_pytorch(group: int | None) -> None:
    torch.manual_seed(0)
    x = torch.randn(37, 320, device="cuda", dtype=torch.bfloat16) * 3
    q, s = kernels.quant_tokens(x) if group is None else kernels.quant_token_groups(x, group)
    ref_q, ref_s = quantize_tokens(x) if group is None else quantize_token_groups(x, group)
    assert q.shape == ref_q.shape and s.shape == ref_s.shape
    torch.testing.assert_close(s, ref_s, rtol=1e-6, atol=0)
    # Division may round differently by one FP8 step in rare elements: compare the de-quantized values.
    torch.testing.assert_close(q.float(), ref_q.float(), rtol=0.13, atol=0)


@pytest.mark.parametrize("scheme", ["block", "online"])
def test_layers_choose_a_kernel_and_match_the_reference(scheme: str) -> None:
    """Merged QKV, gate/up and row-parallel layers built by the method run its GPU kernel."""
    torch.manual_seed(0)
    method_scheme = FP8Scheme("fp8", "block", "weight_scale_inv", (128, 128)) if scheme == "block" else ONLINE
    # The defaults, untuned: the bound below is against the product with activations quantized as the default
    # kernel quantizes them (a tuned layer may run weight-only FP8; the tuning's own test covers that).
    method = FP8Method(method_scheme, torch.bfloat16, torch.device("cuda"), tune=False)
    kw = {"dtype": torch.bfloat16, "device": torch.device("cuda"), "quant": method}
    layers = [
        QKVParallelLinear(192, 32, 6, 2, **kw),
        ColumnParallelLinear(192, [320, 320], **kw),
        RowParallelLinear(320, 192, **kw),
    ]
    for layer in layers:
        assert layer.fp8_path == ("block" if scheme == "block" else "scaled_mm")
        _load_random_weights(layer, method, scheme)
        x = torch.randn(5, layer.in_features, device="cuda", dtype=torch.bfloat16)
        scale = getattr(layer, method.scale_name)
        block_k = 128 if scheme == "block" else None
        assert rel_err(layer(x), reference_w8a8_linear(x, layer.weight, scale, block_k, None)) < 0.02


def _decisive_agreement(ref_outs, got_outs, margin: float) -> int:  # noqa: ANN001
    """Assert that ``got`` picks ``ref``'s greedy token wherever ``ref``'s top token leads the runner-up by more
    than ``margin`` nats, up to each prompt's first difference; return how many decisive tokens were compared."""
    decisive = 0
    for ref, got in zip(ref_outs, got_outs, strict=True):
        for lp, token in zip(ref.logprobs, got.token_ids, strict=False):
            ranked = sorted((v for _, v in lp.top), reverse=True)
            lead = ranked[0] - ranked[1] if len(ranked) > 1 else float("inf")
            if lead > margin:
                decisive += 1
                assert token == lp.token_id, f"chose {token} where the reference's {lp.token_id} led by {lead:.2f}"
            if token != lp.token_id:
                break
    return decisive


def test_bf16_and_fp8_greedy_agree_on_a_tiny_model(tmp_path) -> None:
    """The same tiny model in bf16 and quantized at load to FP8: wherever bf16's greedy choice is decisive
    (its top token leads the runner-up by more than ``MARGIN`` nats), FP8 picks the same token.

    Compared up to each prompt's first difference (after it the prefixes differ). A random tiny model's logits
    are nearly flat, so FP8's rounding (about 3% per value) flips close calls: on the H200 only 19 of 64 tokens
    came before the first difference. A close call may differ; a decisive one may not."""
    from minisgl import LLM, SamplingParams
    from minisgl.testing.models import random_prompts, save_tiny_model

    save_tiny_model("LlamaForCausalLM", tmp_path, hidden_size=256, intermediate_size=512, head_dim=64)
    prompts = random_prompts([9, 21, 40, 64, 12, 30, 50, 17], vocab_size=512, seed=1)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = {}
    for quant in ("none", "fp8"):
        with LLM(str(tmp_path), device="cuda", dtype="bfloat16", quantization=quant, cuda_graph_max_bs=0) as llm:
            outs[quant] = llm.generate(prompts, params)
    decisive = _decisive_agreement(outs["none"], outs["fp8"], margin=0.5)
    assert decisive >= 4, f"only {decisive} decisive greedy choices: the comparison tested too little"


def test_fp8_weights_under_cuda_graphs_agree_with_eager_decode(tmp_path) -> None:
    """An FP8 model (quantized at load, GEMMs tuned) decoding in CUDA graphs picks the eager engine's greedy
    token wherever that one is decisive (0.5 nats, as against bf16: each engine tunes its own GEMMs, and two
    candidates may quantize activations differently, weight-only FP8 not at all)."""
    from minisgl import LLM, SamplingParams
    from minisgl.testing.models import random_prompts, save_tiny_model

    save_tiny_model("LlamaForCausalLM", tmp_path, hidden_size=256, intermediate_size=512, head_dim=64)
    prompts = random_prompts([9, 21, 40, 64, 12, 30, 50], vocab_size=512, seed=2)  # 7: a padded graph batch
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = {}
    for graphs in (0, 16):
        kw = {"quantization": "fp8", "cuda_graph_max_bs": graphs}
        with LLM(str(tmp_path), device="cuda", dtype="bfloat16", **kw) as llm:
            outs[graphs] = llm.generate(prompts, params)
    decisive = _decisive_agreement(outs[0], outs[16], margin=0.5)
    assert decisive >= 4, f"only {decisive} decisive greedy choices: the comparison tested too little"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the fused MoE backend needs Triton")
def test_fp8_moe_checkpoint_runs_fp8_experts_and_agrees_with_its_dequantized_weights(tmp_path) -> None:
    """A Qwen3-MoE FP8 checkpoint (block-wise, experts per expert) on CUDA keeps its experts in FP8 for the fused
    backend; eager and under CUDA graphs it picks the greedy token of the same weights de-quantized into a bf16
    checkpoint wherever that one is decisive (0.5 nats: activations are quantized by the FP8 GEMMs, not by
    the experts, which run weight-only FP8)."""
    import json

    from minisgl_plugin_fp8.testing import write_fp8_checkpoint
    from safetensors.torch import save_file

    from minisgl import LLM, SamplingParams
    from minisgl.testing.models import random_prompts, save_tiny_model

    fields = {"hidden_size": 256, "moe_intermediate_size": 384, "intermediate_size": 512, "head_dim": 64}
    save_tiny_model("Qwen3MoeForCausalLM", tmp_path / "float", num_experts=8, num_experts_per_tok=2, **fields)
    state = write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", "fp8-block")
    (tmp_path / "dequantized").mkdir()
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "dequantized" / "config.json").write_text(json.dumps(config))
    bf16 = {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}
    save_file(bf16, str(tmp_path / "dequantized" / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_prompts([9, 21, 40, 64, 12, 30, 50], vocab_size=512, seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    kw = {"device": "cuda", "dtype": "bfloat16", "moe_backend": "fused"}
    with LLM(str(tmp_path / "dequantized"), cuda_graph_max_bs=0, **kw) as llm:
        ref = llm.generate(prompts, params)
    for graphs in (0, 16):
        with LLM(str(tmp_path / "fp8"), cuda_graph_max_bs=graphs, **kw) as llm:
            experts = llm.engine.model.model.layers[0].mlp.experts
            assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.scales is not None
            assert experts.scales.block_k == 128 and tuple(experts.scales.w13.shape) == (8, 2 * 384, 2)
            got = llm.generate(prompts, params)
            llm.check_accounting()
        decisive = _decisive_agreement(ref, got, margin=0.5)
        print(f"RESULT fp8-moe cuda_graph_max_bs={graphs} decisive={decisive}")
        assert decisive >= 4, f"only {decisive} decisive greedy choices: the comparison tested too little"


class TestFP8BlockOnCuda(cpu_kit.TestFP8Block):
    """The conformance kit on the GPU kernels (block: Triton; per tensor/channel: torch._scaled_mm)."""

    device = "cuda"
    dtype = torch.bfloat16
    max_rel_err = 0.08  # activations quantized to FP8 per token (see the module docstring)


def _fused_backend():  # noqa: ANN202 - the qwen3-moe plugin's Triton backend, imported when a test builds it
    from minisgl_plugin_qwen3_moe.fused_moe import FusedMoEBackend

    return FusedMoEBackend()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the fused MoE backend needs Triton")
class TestFP8BlockFusedExpertsOnCuda(TestFP8BlockOnCuda):
    """The kit's experts test with the experts kept in FP8 for the fused backend (the tile de-quantization)."""

    expert_backend = staticmethod(_fused_backend)


class TestFP8PerTensorOnCuda(cpu_kit.TestFP8PerTensor):
    device, dtype, max_rel_err = "cuda", torch.bfloat16, 0.08


class TestCompressedTensorsChannelOnCuda(cpu_kit.TestCompressedTensorsChannel):
    device, dtype, max_rel_err = "cuda", torch.bfloat16, 0.08


def _same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("rows", [1, 5, 37, 300])
@pytest.mark.parametrize("hidden", [192, 1000, 4096])
@pytest.mark.parametrize("residual", [False, True])
def test_fused_rmsnorm_quantization_equals_the_kernel_sets_norm_then_the_gemms_quantization(
    rows: int, hidden: int, residual: bool
) -> None:
    """add_rmsnorm_quant writes the FP8 values and scales that the model's kernel set's add_rmsnorm followed by
    the GEMMs' quant_tokens give, bit for bit (with minisgl-plugin-triton's kernel set, whose rounding it
    reproduces), and the same residual sum."""
    from minisgl.kernel import select_kernels

    torch.manual_seed(rows + hidden)
    ks = select_kernels(torch.device("cuda"), torch.bfloat16)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16) * 2
    r = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16) if residual else None
    w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    y, want_res = ks.add_rmsnorm(x, r, w, 1e-6)
    want_q, want_s = kernels.quant_tokens(y)
    got, got_res = kernels.add_rmsnorm_quant(x, r, w, 1e-6)
    assert got.dtype == torch.bfloat16 and got.scales.shape == (rows, 1)
    assert torch.equal(got_res, want_res)
    if ks.name == "triton":
        assert torch.equal(got.scales, want_s) and _same_fp8(got.values, want_q)
    else:  # another kernel set may round the norm differently: one FP8 step at most
        torch.testing.assert_close(got.scales, want_s, rtol=1e-2, atol=0)
        torch.testing.assert_close(got.dequantize(), (want_q.float() * want_s).to(torch.bfloat16), rtol=0.13, atol=0)


@pytest.mark.parametrize("rows", [1, 7, 260])
@pytest.mark.parametrize("n", [96, 1000, 12288, 14336])
def test_fused_silu_mul_quantization_equals_the_kernel_sets_silu_mul_then_the_gemms_quantization(
    rows: int, n: int
) -> None:
    from minisgl.kernel import select_kernels

    torch.manual_seed(rows + n)
    ks = select_kernels(torch.device("cuda"), torch.bfloat16)
    gate_up = torch.randn(rows, 2 * n, device="cuda", dtype=torch.bfloat16) * 3
    want_q, want_s = kernels.quant_tokens(ks.silu_mul(gate_up))
    got = kernels.silu_mul_quant(gate_up)
    if ks.name == "triton":
        assert torch.equal(got.scales, want_s) and _same_fp8(got.values, want_q)
    else:
        torch.testing.assert_close(got.scales, want_s, rtol=1e-2, atol=0)


@pytest.mark.parametrize("path", ["scaled_mm", "scaled_mm_fast", "tensor_epi", "w8a8"])
def test_per_token_gemms_given_a_quantized_input_equal_themselves_given_the_activation(path: str) -> None:
    """A per-token GEMM handed its input already quantized skips its own quantization and gives the same output
    as from the 16-bit activation (the values being the same)."""
    torch.manual_seed(0)
    method = FP8Method(ONLINE, torch.bfloat16, torch.device("cuda"), paths=(path,))
    gemm = method._gemm(path)
    w, scale, _ = _weights(512, 384, "ct-channel")
    x = torch.randn(9, 512, device="cuda", dtype=torch.bfloat16)
    q, s = kernels.quant_tokens(x)
    from minisgl.layers import QuantizedActivation

    assert torch.equal(gemm(QuantizedActivation(q, s, x.dtype), w, scale, None), gemm(x, w, scale, None))


@pytest.mark.parametrize("graphs", [0, 16])
def test_fused_producers_leave_an_fp8_models_tokens_and_logprobs_unchanged(tmp_path, monkeypatch, graphs: int) -> None:
    """An FP8 model whose norms and SiLU x up quantize its GEMMs' inputs decodes exactly as with the
    quantization in the GEMMs (MINISGL_FP8_FUSE=0): the same tokens and log-probabilities, eagerly and in CUDA
    graphs. The GEMMs are untuned (MINISGL_FP8_TUNE=0) so both engines run the same kernels."""
    from minisgl import LLM, SamplingParams
    from minisgl.testing.models import random_prompts, save_tiny_model

    save_tiny_model("Qwen3ForCausalLM", tmp_path, hidden_size=256, intermediate_size=512, head_dim=64)
    prompts = random_prompts([9, 21, 40, 64, 12, 30, 50], vocab_size=512, seed=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    monkeypatch.setenv("MINISGL_FP8_TUNE", "0")
    outs, fused = {}, {}
    for fuse in ("1", "0"):
        monkeypatch.setenv("MINISGL_FP8_FUSE", fuse)
        kw = {"quantization": "fp8", "cuda_graph_max_bs": graphs}
        with LLM(str(tmp_path), device="cuda", dtype="bfloat16", **kw) as llm:
            layer = llm.engine.model.model.layers[0]
            fused[fuse] = [
                p.fused_input is not None
                for p in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            ]
            outs[fuse] = llm.generate(prompts, params)
    assert fused == {"1": [True, True, True], "0": [False, False, False]}
    for a, b in zip(outs["1"], outs["0"], strict=True):
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]
