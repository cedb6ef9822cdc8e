"""The fused backend on a CUDA GPU: kernels against the torch backend, and the tiny model end to end.

Skipped without a GPU. Measured numbers are printed (run with ``-s``) and the
results of a run on an H200 are committed under docs/benchmarks/.
"""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.moe import TorchMoEBackend, route
from minisgl.testing.models import hf_greedy, random_prompts

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOKENS = [1, 64, 333, 8192]
ROUTING = [(8, 1), (64, 4), (128, 8)]  # (experts, top_k)


def random_layer(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):  # noqa: ANN201
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=gen)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter**-0.5).to(dtype)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    logits[:, experts // 2 :: 7] -= 100.0  # some experts receive no token
    weights, ids = route(logits, top_k, renormalize=top_k % 2 == 0)
    return x, w13, w2, weights, ids


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize(("experts", "top_k"), ROUTING, ids=[f"E{e}-top{k}" for e, k in ROUTING])
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_matches_torch_bf16(tokens: int, experts: int, top_k: int) -> None:
    from minisgl_plugin_qwen3_moe.fused_moe import FusedMoEBackend

    x, w13, w2, weights, ids = random_layer(tokens, experts, top_k, 1024, 384, torch.bfloat16, seed=tokens + experts)
    ref = TorchMoEBackend().forward(x, w13, w2, weights, ids)
    # The one-program Triton alignment is what small batches use; check it against the sort-based one there.
    for align in ("triton", "torch") if tokens * top_k <= 1024 else ("torch",):
        out = FusedMoEBackend(align_method=align).forward(x, w13, w2, weights, ids)
        err = rel_error(out, ref)
        print(f"RESULT kernel tokens={tokens} experts={experts} top_k={top_k} align={align} rel_error={err:.2e}")
        assert err < 1e-2


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_fused_matches_torch_qwen3_30b_shapes(tokens: int) -> None:
    from minisgl_plugin_qwen3_moe.fused_moe import FusedMoEBackend

    x, w13, w2, weights, ids = random_layer(tokens, 128, 8, 2048, 768, torch.bfloat16, seed=tokens)
    ref = TorchMoEBackend().forward(x, w13, w2, weights, ids)
    err = rel_error(FusedMoEBackend().forward(x, w13, w2, weights, ids), ref)
    print(f"RESULT kernel-30b tokens={tokens} rel_error={err:.2e}")
    assert err < 1e-2


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="Triton converts float8 e4m3 on compute capability 8.9+",
)
@pytest.mark.parametrize("block", [128, None], ids=["block128", "per-row"])
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_fused_fp8_experts_match_torch_on_dequantized_weights(tokens: int, block: int | None) -> None:
    """FP8 experts (Qwen3-30B-A3B shapes), de-quantized tile by tile, against the torch backend on the same
    weights de-quantized to bf16 up front: the same bf16 products, so the bf16 bound."""
    from minisgl_plugin_qwen3_moe.fp8 import quantize_experts
    from minisgl_plugin_qwen3_moe.fused_moe import FusedMoEBackend

    from minisgl.moe import ExpertScales

    x, w13, w2, weights, ids = random_layer(tokens, 128, 8, 2048, 768, torch.bfloat16, seed=tokens + 7)
    q13, s13, d13 = quantize_experts(w13, block)
    q2, s2, d2 = quantize_experts(w2, block)
    ref = TorchMoEBackend().forward(x, d13, d2, weights, ids)
    backend = FusedMoEBackend()
    assert torch.float8_e4m3fn in backend.expert_dtypes
    err = rel_error(backend.forward(x, q13, q2, weights, ids, scales=ExpertScales(s13, s2, block)), ref)
    print(f"RESULT kernel-30b-fp8 tokens={tokens} block={block} rel_error={err:.2e}")
    assert err < 1e-2


def test_fused_float32_matches_torch_closely() -> None:
    from minisgl_plugin_qwen3_moe.fused_moe import FusedMoEBackend

    x, w13, w2, weights, ids = random_layer(77, 16, 4, 256, 96, torch.float32, seed=1)
    ref = TorchMoEBackend().forward(x, w13, w2, weights, ids)
    torch.testing.assert_close(FusedMoEBackend().forward(x, w13, w2, weights, ids), ref, rtol=1e-4, atol=1e-4)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def test_tiny_model_greedy_agreement(tiny_moe) -> None:
    path, model = tiny_moe
    prompts = random_prompts([5, 17, 120, 40, 9, 33, 64, 200], model.config.vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    reference = hf_greedy(model, prompts, 32)  # transformers, float32, CPU
    with LLM(str(path), device="cuda", dtype="float32", moe_backend="fused") as llm:
        assert type(llm.engine.moe_backend).__name__ == "FusedMoEBackend"
        fp32 = [o.token_ids for o in llm.generate(prompts, params)]
    runs = {}
    for backend in ("torch", "fused"):
        with LLM(str(path), device="cuda", dtype="bfloat16", moe_backend=backend) as llm:
            runs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    # Teacher-forced bf16 check: both backends score the same token sequences (prompt + reference continuation),
    # so one early near-tie does not make every later position count as a disagreement.
    full = [p + r for p, r in zip(prompts, reference, strict=True)]
    argmax = {}
    for backend in ("torch", "fused"):
        with LLM(str(path), device="cuda", dtype="bfloat16", moe_backend=backend) as llm:
            argmax[backend] = [
                [o.token_ids[0] for o in llm.generate([s[:n] for n in range(len(p), len(s))], _one_token())]
                for p, s in zip(prompts, full, strict=True)
            ]
    fp32_vs_hf = agreement(fp32, reference)
    bf16_free = agreement(runs["fused"], runs["torch"])
    bf16_forced = agreement(argmax["fused"], argmax["torch"])
    print(
        f"RESULT model fp32 fused vs transformers: {fp32_vs_hf:.4f}; bf16 fused vs torch free-running: "
        f"{bf16_free:.4f}; bf16 fused vs torch teacher-forced: {bf16_forced:.4f}"
    )
    assert fp32_vs_hf >= 0.99
    assert bf16_forced >= 0.99


def _one_token() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
