"""The Triton kernels against the core's PyTorch arithmetic (CUDA only; skipped elsewhere)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from minisgl_plugin_triton.kernels import TritonKernels

from minisgl.kernel import rms_norm
from minisgl.testing.kernels import KernelSetConformance

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class TestTritonKernelSetBF16(KernelSetConformance):
    kernel_set = "minisgl_plugin_triton.kernels:triton_kernels"
    device = "cuda"
    dtype = torch.bfloat16


class TestTritonKernelSetFloat32(TestTritonKernelSetBF16):
    dtype = torch.float32
    atol = rtol = 1e-4  # fused reductions sum in another order than PyTorch's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_norm_and_rope_match_the_torch_layers(dtype: torch.dtype) -> None:
    """The fused kernels against the layers' own PyTorch arithmetic, on strided inputs."""
    from minisgl_plugin_triton.norm_rope import qk_norm_rope, rmsnorm

    from minisgl.layers import RMSNorm, RotaryEmbedding

    dev = torch.device("cuda")
    torch.manual_seed(0)
    norm = RMSNorm(1024, 1e-6, dtype=dtype, device=dev)
    norm.weight.normal_()
    x, res = torch.randn(37, 1024, dtype=dtype, device=dev), torch.randn(37, 1024, dtype=dtype, device=dev)
    ref_out, ref_res = rms_norm(x + res, norm.weight, 1e-6), x + res
    out, new_res = rmsnorm(x, norm.weight, 1e-6, res)
    assert torch.equal(new_res, ref_res)
    assert float((out.float() - ref_out.float()).norm() / ref_out.float().norm()) < 1e-2
    heads = torch.randn(37, 16, 128, dtype=dtype, device=dev)
    head_norm = RMSNorm(128, 1e-6, dtype=dtype, device=dev)
    ref = rms_norm(heads, head_norm.weight, 1e-6)
    assert float((rmsnorm(heads, head_norm.weight, 1e-6).float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    rot = RotaryEmbedding(128, 4096, {"rope_theta": 1e6, "rope_type": "default"}, device=dev)
    qkv = torch.randn(37, (16 + 8 + 8) * 128, dtype=dtype, device=dev)
    q, k = qkv[:, : 16 * 128].view(37, 16, 128), qkv[:, 16 * 128 : 24 * 128].view(37, 8, 128)
    pos = torch.randint(0, 4096, (37,), device=dev)
    cos, sin = rot.cos_sin[pos].unsqueeze(1).chunk(2, dim=-1)
    rotated = qk_norm_rope(q, k, rot.cos_sin, pos)  # rotary only: no q/k norm weights
    for t, got in zip((q, k), rotated, strict=True):
        t1, t2 = t.float().chunk(2, dim=-1)
        expect = torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1).to(dtype)
        assert float((got.float() - expect.float()).norm() / expect.float().norm()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(16, 8, 128), (9, 3, 64), (4, 1, 256)])
def test_fused_qk_norm_rope_matches_the_separate_layers(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int):
    """One launch for q/k RMSNorm + rotary against the PyTorch layers (norm, then rope), strided inputs."""
    from minisgl_plugin_triton.norm_rope import qk_norm_rope

    from minisgl.layers import RMSNorm, RotaryEmbedding

    dev = torch.device("cuda")
    torch.manual_seed(1)
    rot = RotaryEmbedding(
        head_dim, 4096, {"rope_theta": 1e6, "rope_type": "default"}, device=dev, kernels=TritonKernels()
    )
    q_norm, k_norm = (RMSNorm(head_dim, 1e-6, dtype=dtype, device=dev) for _ in range(2))
    q_norm.weight.normal_()
    k_norm.weight.normal_()
    for tokens in (1, 37, 300):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=dev)
        q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        pos = torch.randint(0, 4096, (tokens,), device=dev)
        cos, sin = rot.cos_sin[pos].unsqueeze(1).chunk(2, dim=-1)
        for norms in (None, (q_norm, k_norm)):
            got_q, got_k = qk_norm_rope(q, k, rot.cos_sin, pos, *((n.weight for n in norms) if norms else ()), eps=1e-6)
            for got, t, norm in ((got_q, q, norms and norms[0]), (got_k, k, norms and norms[1])):
                src = rms_norm(t, norm.weight, norm.eps) if norm else t
                t1, t2 = src.float().chunk(2, dim=-1)
                expect = torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1).to(dtype)
                assert got.shape == expect.shape and got.is_contiguous()
                assert not got.isnan().any()
                assert float((got.float() - expect.float()).norm() / expect.float().norm()) < 1e-2
                # The same roundings as the layers: almost every element is bit-identical.
                assert float((got == expect).float().mean()) > 0.99
        # The rotary layer built with the triton set takes the fused path and agrees with the kernel.
        lq, lk = rot(pos, q, k, (q_norm, k_norm))
        fq, fk = qk_norm_rope(q, k, rot.cos_sin, pos, q_norm.weight, k_norm.weight, q_norm.eps)
        assert torch.equal(lq, fq) and torch.equal(lk, fk)


def test_triton_sampler_draws_from_the_softmax_and_is_greedy_at_zero_temperature() -> None:
    """The two-pass Gumbel-max sampler: argmax rows equal torch.argmax, sampled rows follow softmax(x/T)."""
    from minisgl_plugin_triton.sampling import CHUNK, gumbel_sample

    dev = torch.device("cuda")
    torch.manual_seed(3)
    vocab = 2 * CHUNK + 3617  # three chunks, the last one partial
    # Greedy: ties resolve to the lowest index, across chunk boundaries too.
    logits = torch.randn(64, vocab, device=dev).to(torch.bfloat16)
    logits[5, [CHUNK + 7, 2 * CHUNK + 1]] = 100.0
    greedy = gumbel_sample(logits, torch.zeros(64, device=dev), seed=11)
    assert torch.equal(greedy, logits.float().argmax(dim=-1))
    assert int(greedy[5]) == CHUNK + 7
    # Sampling: five live tokens spread over the chunks, each row an independent draw.
    hot = torch.tensor([3, CHUNK - 1, CHUNK, 2 * CHUNK + 100, vocab - 1], device=dev)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], device=dev)
    temp = 0.7
    row = torch.full((vocab,), -1e4, device=dev)
    row[hot] = probs.log() * temp  # softmax(row / temp) puts `probs` on `hot`
    n = 20000
    draws = gumbel_sample(row.expand(n, vocab), torch.full((n,), 1 / temp, device=dev), seed=5)
    counts = torch.stack([(draws == h).sum() for h in hot]).float()
    assert int(counts.sum()) == n  # nothing outside the live tokens
    sigma = (n * probs * (1 - probs)).sqrt()
    assert bool(((counts - n * probs).abs() < 5 * sigma).all()), counts
    # Same seed, same draws; another seed, other draws.
    again = gumbel_sample(row.expand(n, vocab), torch.full((n,), 1 / temp, device=dev), seed=5)
    other = gumbel_sample(row.expand(n, vocab), torch.full((n,), 1 / temp, device=dev), seed=6)
    assert torch.equal(draws, again) and not torch.equal(draws, other)


def test_triton_sampler_with_the_hardware_logarithm_draws_what_the_exact_one_draws() -> None:
    """The noise's logarithms by lg2.approx (the default on a GPU) against the exact ones, same seed: the same
    token in nearly every row of a model-sized vocabulary (they can differ only where two scores are within
    ~1e-4), and the tails kept: a token of probability 1e-3 drawn as often as that, and a flat row's winner
    spread evenly over the vocabulary."""
    from minisgl_plugin_triton.sampling import gumbel_sample

    dev = torch.device("cuda")
    torch.manual_seed(4)
    vocab, rows = 151936, 1024
    logits = (torch.randn(rows, vocab, device=dev) * 3).to(torch.bfloat16)
    inv = torch.full((rows,), 1 / 0.6, device=dev)
    fast = gumbel_sample(logits, inv, seed=21)
    exact = gumbel_sample(logits, inv, seed=21, fast_log=False)
    assert float((fast == exact).float().mean()) >= 0.99
    # A rare token: probabilities 0.999 and 0.001 on two tokens, the rest impossible.
    n = 200_000
    row = torch.full((4096,), float("-inf"), device=dev)
    row[[10, 3000]] = torch.tensor([0.999, 0.001], device=dev).log()
    draws = gumbel_sample(row.expand(n, 4096), torch.ones(n, device=dev), seed=8)
    rare = int((draws == 3000).sum())
    assert int(((draws == 10) | (draws == 3000)).sum()) == n
    assert abs(rare - 200) < 5 * 200**0.5, rare
    # A flat row: the winner is uniform over the whole vocabulary (16 equal bins, chi-square with 15 degrees of
    # freedom under its 0.1 % critical value 37.7).
    n = 32_000
    zeros = torch.zeros(vocab, device=dev, dtype=torch.bfloat16).expand(n, vocab)
    flat = gumbel_sample(zeros, torch.ones(n, device=dev), seed=9)
    counts = torch.bincount(flat * 16 // vocab, minlength=16).float()
    assert float(((counts - n / 16) ** 2 / (n / 16)).sum()) < 37.7, counts


def test_fp8_kv_pool_stores_through_the_triton_kernel() -> None:
    """An FP8 pool hands the kernel set its float8 layer views and the layer's scales: the triton store
    quantizes and writes both rows in one launch, and the pool then holds exactly what the PyTorch reference
    pool holds (whose store quantizes, then copies bytes)."""
    from minisgl.kvcache import KVLayout, MHAKVPool

    dev = torch.device("cuda")
    layout = KVLayout(2, 9, 16, 4, 128, torch.float8_e4m3fn, dev, k_scales=(0.5, 2.0), v_scales=(2.0, 0.25))
    fast, ref = MHAKVPool(replace(layout, kernels=TritonKernels())), MHAKVPool(layout)
    qkv = torch.randn(37, (8 + 2 * 4) * 128, device=dev, dtype=torch.bfloat16) * 50  # some beyond +-448
    k, v = (t.view(37, 4, 128) for t in qkv[:, 8 * 128 :].split(4 * 128, dim=-1))  # strided, as the layers pass
    loc = torch.randperm(9 * 16, device=dev)[:37]
    for layer in (0, 1):
        fast.store_kv(k, v, loc, layer)
        ref.store_kv(k, v, loc, layer)
        for a, b in ((fast.k_cache(layer), ref.k_cache(layer)), (fast.v_cache(layer), ref.v_cache(layer))):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert fast.k_cache(1).view(torch.uint8).any()
    # One launch per store, where the reference takes five (clamp and cast of k and of v, then the copy).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fast.store_kv(k, v, loc, 0)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and "store_kv" in kernels[0].name, [e.name for e in kernels]
