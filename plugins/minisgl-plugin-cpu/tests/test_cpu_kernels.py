"""The native CPU kernels (minisgl_plugin_cpu.native) against PyTorch, and how they are built and found."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from minisgl_plugin_cpu import native as cpu
from minisgl_plugin_cpu.kernels import NativeCPUKernels

from minisgl import LLM, SamplingParams
from minisgl.kernel import KernelSet, select_kernels
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.testing.models import random_prompts

needs_compiler = pytest.mark.skipif(cpu.find_compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def kernels() -> cpu.CpuKernels:
    if cpu.find_compiler() is None:
        pytest.skip("no C compiler on this machine")
    k = cpu.load_cpu_kernels()
    assert k is not None, "a C compiler is installed, so the kernels must build"
    return k


@pytest.fixture
def fresh_loader() -> Iterator[None]:
    """Forget the process's loaded kernels before and after a test that changes how they load."""
    cpu.load_cpu_kernels.cache_clear()
    yield
    cpu.load_cpu_kernels.cache_clear()


def _column_major(m: int, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, m, generator=gen).t()


# ------------------------------------------------------------------ decode attention
def _paged_case(lengths: list[int], hq: int, hkv: int, d: int, page_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = -(-max(lengths) // page_size)
    num_pages = len(lengths) * pages_per_req + 3
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen)
    width = pages_per_req * page_size + 5
    table = torch.zeros(2 * len(lengths), width, dtype=torch.int32)
    pages = torch.randperm(num_pages, generator=gen)[: len(lengths) * pages_per_req].view(len(lengths), -1)
    rows = torch.arange(len(lengths), dtype=torch.int64) * 2 + 1  # every other table row: rows are looked up
    for i, req_pages in enumerate(pages):
        slots = (req_pages.view(-1, 1) * page_size + torch.arange(page_size)).view(-1)
        table[rows[i], : slots.numel()] = slots.to(torch.int32)
    # q as a strided view (a slice of a wider row), the way a fused qkv GEMM leaves it.
    qkv = torch.randn(len(lengths), (hq + 2 * hkv) * d, generator=gen)
    q = qkv[:, : hq * d].view(len(lengths), hq, d)
    return q, k_cache, v_cache, table, rows, torch.tensor(lengths, dtype=torch.int64)


def _attention_reference(q, k_cache, v_cache, table, rows, lens, scale) -> torch.Tensor:
    b, hq, d = q.shape
    hkv = k_cache.shape[-2]
    flat_k, flat_v = k_cache.reshape(-1, hkv, d).double(), v_cache.reshape(-1, hkv, d).double()
    out = []
    for i in range(b):
        slots = table[rows[i], : lens[i]].long()
        k = flat_k[slots].repeat_interleave(hq // hkv, dim=1)
        v = flat_v[slots].repeat_interleave(hq // hkv, dim=1)
        probs = (torch.einsum("hd,thd->ht", q[i].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("ht,thd->hd", probs, v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (9, 3), (8, 1), (16, 2)])
@pytest.mark.parametrize("d", [8, 20, 64, 128, 256])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_attention_matches_float64_reference(kernels, hq: int, hkv: int, d: int, page_size: int) -> None:
    lengths = [1, 7, 8, 9, 64, 333, 17]  # around the 8-position blocks, and a lone position
    q, kc, vc, table, rows, lens = _paged_case(lengths, hq, hkv, d, page_size, seed=hq * d + page_size)
    got = kernels.decode_attention(q, kc, vc, table, rows, lens, d**-0.5)
    assert got.shape == (len(lengths), hq * d)
    want = _attention_reference(q, kc, vc, table, rows, lens, d**-0.5)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("batch", [1, 3, 40])  # one KV head per work item below 4 requests per thread, all above
def test_decode_attention_peaked_and_flat_scores(kernels, batch: int) -> None:
    """Scores 30 apart (exact in float32) make most weights underflow; a zero query makes them all equal."""
    lengths = [50 + 13 * i for i in range(batch)]
    q, kc, vc, table, rows, lens = _paged_case(lengths, 6, 2, 64, 16, seed=batch)
    gen = torch.Generator().manual_seed(batch)
    kc[..., 0] = torch.randint(-3, 4, kc.shape[:-1], generator=gen).float() * 30
    peaked = torch.zeros_like(q)
    peaked[..., 0] = 1.0
    got = kernels.decode_attention(peaked, kc, vc, table, rows, lens, 1.0)
    want = _attention_reference(peaked, kc, vc, table, rows, lens, 1.0)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    zero = torch.zeros_like(q)
    got = kernels.decode_attention(zero, kc, vc, table, rows, lens, 1.0)
    want = _attention_reference(zero, kc, vc, table, rows, lens, 1.0)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)


def test_decode_attention_rejects_what_it_cannot_read(kernels) -> None:
    q, kc, vc, table, rows, lens = _paged_case([5, 6], 4, 2, 16, 4, seed=0)
    assert kernels.decode_attention(q[:0], kc, vc, table, rows[:0], lens[:0], 0.25).shape == (0, 64)
    with pytest.raises(ValueError, match="int64"):
        kernels.decode_attention(q, kc, vc, table, rows.int(), lens, 0.25)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.decode_attention(q, kc.transpose(0, 1), vc, table, rows, lens, 0.25)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.decode_attention(q.transpose(1, 2), kc, vc, table, rows, lens, 0.25)


# ------------------------------------------------------------------ GEMM
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 20])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (7, 13), (50, 577), (3, 8)])  # tails in n (3-row tiles) and k (8)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(kernels, m: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    x_wide = torch.randn(m, k + 5, generator=gen)
    x = x_wide[:, 2 : k + 2]  # rows contiguous, row stride larger than k
    weight = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = kernels.linear(x, weight, b)
    assert got.shape == (m, n) and got.is_contiguous()
    want = (x.double() @ weight.double().t() + (b.double() if b is not None else 0)).float()
    torch.testing.assert_close(got, want, atol=1e-5 * k**0.5, rtol=1e-5)


def test_layers_use_the_kernel_gemm_only_for_few_rows(kernels, monkeypatch) -> None:
    native = NativeCPUKernels(kernels)
    calls: list[int] = []
    real = cpu.CpuKernels.linear

    def spy(self, x, weight, bias=None):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return real(self, x, weight, bias)

    monkeypatch.setattr(cpu.CpuKernels, "linear", spy)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 24, generator=gen)
    for rows in (1, kernels.GEMM_MAX_ROWS, kernels.GEMM_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 24, generator=gen)
        got = native.linear(x, weight)
        torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5, rtol=1e-5)
    assert calls == [1, kernels.GEMM_MAX_ROWS]


# ------------------------------------------------------------------ elementwise kernels
@pytest.mark.parametrize("m", [1, 5, 32, 300])
@pytest.mark.parametrize("n", [37, 576])
@pytest.mark.parametrize("layout", ["row", "column"])
def test_rmsnorm_with_and_without_residual(kernels, m: int, n: int, layout: str) -> None:
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, n, generator=gen) if layout == "row" else _column_major(m, n, gen)
    residual, weight = torch.randn(m, n, generator=gen), torch.randn(n, generator=gen)
    out, summed = kernels.rmsnorm(x, weight, 1e-6)
    assert summed is None and out.is_contiguous()
    torch.testing.assert_close(out, F.rms_norm(x, (n,), weight, 1e-6), atol=1e-5, rtol=1e-5)
    out, summed = kernels.rmsnorm(x, weight, 1e-6, residual)
    assert summed is not None and torch.equal(summed, x + residual)
    torch.testing.assert_close(out, F.rms_norm(x + residual, (n,), weight, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("m", [1, 6, 32, 129])
@pytest.mark.parametrize("n", [13, 1536])
@pytest.mark.parametrize("layout", ["row", "column"])
def test_silu_mul(kernels, m: int, n: int, layout: str) -> None:
    gen = torch.Generator().manual_seed(m * n)
    gate_up = torch.randn(m, 2 * n, generator=gen) * 8 if layout == "row" else _column_major(m, 2 * n, gen) * 8
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 120.0, -120.0])  # zero, and exp() far out of range either way
    got = kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-6, rtol=2e-6)
    assert (got.stride(0) == 1) == (layout == "column" and m > 1), "the output keeps the input's layout"


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("layout", ["row", "column"])
def test_rope_equals_the_pytorch_path(kernels, qk_norm: bool, head_dim: int, layout: str) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    tokens, hq, hkv = 7, 6, 2
    rope = RotaryEmbedding(
        head_dim, 512, {"rope_theta": 10000.0, "rope_type": "default"}, kernels=NativeCPUKernels(kernels)
    )
    width = (hq + 2 * hkv) * head_dim
    qkv = torch.randn(tokens, width, generator=gen) if layout == "row" else _column_major(tokens, width, gen)
    q = qkv[:, : hq * head_dim].reshape(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].reshape(tokens, hkv, head_dim)
    positions = torch.tensor([0, 3, 3, 100, 511, 7, 250])
    norms = None
    if qk_norm:
        from minisgl.layers.norm import RMSNorm

        norms = (RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6))
        for norm in norms:
            norm.weight.data.copy_(torch.rand(head_dim, generator=gen) + 0.5)
    got_q, got_k = rope(positions, q, k, norms)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    rope.kernels = KernelSet()  # the PyTorch path, the reference
    want_q, want_k = rope(positions, q, k, norms)
    torch.testing.assert_close(got_q, want_q, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("layout", ["row", "column"])
def test_store_kv_writes_the_slots_and_nothing_else(kernels, layout: str) -> None:
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(40, 2, 8, generator=gen), torch.randn(40, 2, 8, generator=gen)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kv = torch.randn(5, 48, generator=gen) if layout == "row" else _column_major(5, 48, gen)
    k, v = kv[:, 16:32], kv[:, 32:]
    loc = torch.tensor([3, 39, 0, 17, 18])
    kernels.store_kv(k, v, loc, k_cache, v_cache)
    want_k.view(40, 16).index_copy_(0, loc, k)
    want_v.view(40, 16).index_copy_(0, loc, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("m", [1, 7, 8, 9, 33])
@pytest.mark.parametrize("n", [1, 5, 17, 1000])
@pytest.mark.parametrize("layout", ["row", "column"])
def test_argmax_is_torch_argmax(kernels, m: int, n: int, layout: str) -> None:
    gen = torch.Generator().manual_seed(m * n)
    x = torch.randint(-3, 4, (m, n), generator=gen).float()  # many ties: the first maximum must win
    x[0, n // 2] = float("nan") if n > 1 else x[0, 0]
    if m > 2:
        x[2] = float("-inf")
    if m > 3 and n > 3:
        x[3, -1] = float("nan")  # a NaN in the scalar tail of a row
        x[3, 1] = 50.0
    if layout == "column":
        x = x.t().contiguous().t()
    assert torch.equal(kernels.argmax(x), x.argmax(-1))


# ------------------------------------------------------------------ build, cache, fallback
@needs_compiler
def test_build_is_cached_per_source_and_compiler(tmp_path) -> None:
    first = cpu.build(out_dir=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu.build(out_dir=tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name], "no temporary files left behind"


def test_a_compiler_that_fails_is_reported(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(cpu.CpuKernelBuildError, match="no C compiler found"):
        cpu.build(out_dir=tmp_path)
    with pytest.raises(cpu.CpuKernelBuildError, match="could not build"):
        cpu.build(cc="false", out_dir=tmp_path)
    assert not any(tmp_path.iterdir()), "a failed build leaves nothing behind"


def test_without_a_working_compiler_auto_takes_torch(monkeypatch, tmp_path, caplog, fresh_loader, registry) -> None:
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="minisgl_plugin_cpu.native"):
        assert cpu.load_cpu_kernels() is None
    assert "native CPU kernels unavailable, using PyTorch paths" in caplog.text
    assert type(select_kernels("cpu", torch.float32, "auto", registry)) is KernelSet


def _greedy(tiny_dir, registry, prompts, **kwargs) -> list[list[int]]:
    with LLM(str(tiny_dir), registry=registry, page_size=4, **kwargs) as llm:
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        return [o.token_ids for o in out]


@needs_compiler
def test_model_with_kernels_equals_model_without(tiny_dir, registry) -> None:
    prompts = random_prompts([3, 40, 17, 90], 512, seed=5)
    assert _greedy(tiny_dir, registry, prompts) == _greedy(
        tiny_dir, registry, prompts, kernels="torch", attention_backend="torch"
    )
