"""The FP8 KV cache (``kv_cache_dtype="fp8_e4m3"``, and ``"fp8_e5m2"``) on CPU through the torch backend: it
agrees with the unquantized cache within a stated tolerance, holds twice the pages of a bfloat16 cache in the
same memory, takes the checkpoint's k/v scales, and bad configurations are refused by name before anything is
built."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.core import ValidationError
from minisgl.kernel import fp32_reciprocal, quantize_kv
from minisgl.kvcache import QUANTIZED_KV_DTYPES, KVLayout, MHAKVPool
from minisgl.testing.models import prefill_logits, random_prompts

# Teacher-forced logits over an FP8 cache against the unquantized cache (float32 model): relative error of
# the whole logits matrix, and top-1 agreement where the unquantized choice is decisive, per cache dtype.
# (The tiny random model measures 6.4% and 100% of 69 decisive positions for e4m3, 95% top-1 at a 0.05
# threshold, 45 of 48 greedy tokens; e5m2, one mantissa bit less: 13.8%, 97% of decisive positions and 41 of 48.)
FP8_LOGITS_REL_ERROR = {"fp8_e4m3": 0.1, "fp8_e5m2": 0.2}
FP8_TOP1_AGREEMENT = {"fp8_e4m3": 0.99, "fp8_e5m2": 0.95}
FP8_GREEDY_AGREEMENT = {"fp8_e4m3": 0.9, "fp8_e5m2": 0.8}
DECISIVE = 0.2  # top-1 minus top-2 logit, in standard deviations of the row


def _logits(llm: LLM, seqs: list[list[int]]) -> torch.Tensor:
    return prefill_logits(llm, seqs)


def _compare(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    rel = float((got - ref).norm() / ref.norm())
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > DECISIVE * ref.std(dim=-1)
    assert decisive.float().mean() > 0.4, "too few decisive positions to judge"
    same = got.argmax(-1) == ref.argmax(-1)
    return rel, float(same[decisive].float().mean())


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_agrees_with_unquantized(make_llm, kv: str) -> None:
    """Prefill logits over an FP8 cache, then generation with chunked prefill and decode: close to the
    unquantized cache (FP8_LOGITS_REL_ERROR, FP8_TOP1_AGREEMENT), and the pool really stores float8."""
    seqs = random_prompts([40, 9, 70], 512, seed=21)
    ref_llm, fp8_llm = make_llm(), make_llm(kv_cache_dtype="fp8" if kv == "fp8_e4m3" else kv)
    assert fp8_llm.config.kv_cache_dtype == kv  # "fp8" is an alias of fp8_e4m3
    assert fp8_llm.engine.kv_pool.layout.dtype == QUANTIZED_KV_DTYPES[kv]
    assert fp8_llm.engine.kv_pool.k_cache(0).dtype == QUANTIZED_KV_DTYPES[kv]
    assert ref_llm.engine.kv_pool.layout.dtype == torch.float32
    rel, top1 = _compare(_logits(fp8_llm, seqs), _logits(ref_llm, seqs))
    assert rel < FP8_LOGITS_REL_ERROR[kv], f"relative logits error {rel:.3f} over the {kv} cache"
    assert top1 >= FP8_TOP1_AGREEMENT[kv], f"top-1 agreement {top1:.3f} at decisive positions"
    # Greedy generation through chunked prefill and decode: the continuations, teacher-forced through the
    # unquantized cache, are its own decisive choices nearly everywhere.
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    chunked = make_llm(kv_cache_dtype=kv, chunked_prefill_size=16)
    outs = chunked.generate(seqs, params, use_tqdm=False)
    chunked.check_accounting()
    full = [s + o.token_ids[:-1] for s, o in zip(seqs, outs, strict=True)]
    ref = _logits(ref_llm, full)
    starts, agree, total = 0, 0, 0
    for s, o in zip(seqs, outs, strict=True):
        rows = ref[starts + len(s) - 1 : starts + len(s) - 1 + len(o.token_ids)]
        agree += int((rows.argmax(-1) == torch.tensor(o.token_ids)).sum())
        total += len(o.token_ids)
        starts += len(s) + len(o.token_ids) - 1
    assert agree / total >= FP8_GREEDY_AGREEMENT[kv], (
        f"only {agree} of {total} {kv} greedy tokens are the unquantized cache's top-1"
    )


def test_fp8_doubles_the_pages_of_a_bfloat16_cache(make_llm) -> None:
    """The same KV memory holds twice the pages of a bfloat16 cache (four times float32's)."""
    sizing = {"cpu_kv_cache_gb": 0.002, "max_running_requests": 64, "page_size": 4}
    pages = {}
    for dtype in ("float32", "bfloat16"):
        for kv in ("auto", "fp8_e4m3", "fp8_e5m2"):
            llm = make_llm(dtype=dtype, kv_cache_dtype=kv, **sizing)
            layout = llm.engine.kv_pool.layout
            pages[dtype, kv] = layout.num_pages
            assert layout.num_slots * layout.bytes_per_token() <= 0.002 * (1 << 30) + layout.page_size * 4096
    assert pages["float32", "fp8_e4m3"] == pages["bfloat16", "fp8_e4m3"]  # fp8 whatever the model dtype
    assert pages["float32", "fp8_e5m2"] == pages["float32", "fp8_e4m3"]  # one byte a value either way
    for dtype, factor in (("bfloat16", 2), ("float32", 4)):
        assert abs((pages[dtype, "fp8_e4m3"] - 1) - factor * (pages[dtype, "auto"] - 1)) <= factor, pages


def test_unknown_kv_cache_dtype_is_refused_by_name(tiny_dir, registry) -> None:
    before = threading.active_count()
    with pytest.raises(ValidationError, match=r"kv_cache_dtype: .*'auto', 'fp8_e4m3', 'fp8' or 'fp8_e5m2'.*got 'int4'"):
        LLM(str(tiny_dir), registry=registry, kv_cache_dtype="int4")
    assert threading.active_count() == before


def _with_scales(src: Path, dst: Path, extra: dict[str, torch.Tensor]) -> Path:
    """A copy of the tiny checkpoint in ``src`` with ``extra`` tensors added."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file({**load_file(src / "model.safetensors"), **extra}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_checkpoint_kv_scales_are_loaded(tiny_dir, registry, tmp_path) -> None:
    """vLLM / compressed-tensors / ModelOpt scale names load as the pool's per-layer scales; query and softmax
    scales are accepted and unused; a layer with none keeps 1.0; a cache in the model dtype ignores them."""
    scales = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        "model.layers.0.self_attn.q_scale": torch.tensor(3.0),
        "model.layers.1.self_attn.kv_scale": torch.tensor(2.0, dtype=torch.bfloat16),
    }
    path = _with_scales(tiny_dir, tmp_path / "scaled", scales)
    llm = LLM(str(path), registry=registry, kv_cache_dtype="fp8", page_size=4)
    layout = llm.engine.kv_pool.layout
    assert [layout.kv_scales(i) for i in range(layout.num_layers)] == [(0.5, 0.25), (2.0, 2.0)]
    # The pool stores k / scale (64 / 0.5 = 128, 64 / 0.25 = 256), clamped to e4m3's +-448 (a plain cast of
    # 4000 would give NaN).
    pool = llm.engine.kv_pool
    kv = torch.tensor([64.0, -1000.0]).view(2, 1, 1).expand(2, layout.num_kv_heads, layout.head_dim)
    pool.store_kv(kv, kv, torch.tensor([5, 6]), 0)
    k_rows, v_rows = (c.reshape(-1, *kv.shape[1:])[5:7].float() for c in (pool.k_cache(0), pool.v_cache(0)))
    assert k_rows.flatten(1).unique(dim=1).tolist() == [[128.0], [-448.0]]
    assert v_rows.flatten(1).unique(dim=1).tolist() == [[256.0], [-448.0]]
    seqs = random_prompts([30, 12], 512, seed=22)
    ref = LLM(str(tiny_dir), registry=registry, page_size=4)
    rel, top1 = _compare(_logits(llm, seqs), _logits(ref, seqs))
    assert rel < FP8_LOGITS_REL_ERROR["fp8_e4m3"] and top1 >= FP8_TOP1_AGREEMENT["fp8_e4m3"], (rel, top1)
    llm.close()
    # The ModelOpt spelling, on the other layer only: layer 0 keeps 1.0.
    path = _with_scales(
        tiny_dir, tmp_path / "modelopt", {"model.layers.1.self_attn.k_proj.output_scale": torch.tensor(4.0)}
    )
    llm = LLM(str(path), registry=registry, kv_cache_dtype="fp8_e4m3", page_size=4)
    assert llm.engine.kv_pool.layout.k_scales == (1.0, 4.0) and llm.engine.kv_pool.layout.v_scales == (1.0, 1.0)
    llm.close()
    auto = LLM(str(path), registry=registry, page_size=4)
    assert auto.engine.kv_pool.layout.k_scales == () and auto.engine.kv_pool.layout.dtype == torch.float32
    auto.close()
    ref.close()


@pytest.mark.parametrize(
    ("tensor", "error"),
    [(torch.tensor([0.5, 0.5]), r"\(2,\) is not a per-tensor scale"), (torch.tensor(0.0), "positive and finite")],
)
def test_bad_checkpoint_kv_scales_are_refused(tiny_dir, registry, tmp_path, tensor, error) -> None:
    path = _with_scales(tiny_dir, tmp_path / "bad", {"model.layers.0.self_attn.k_scale": tensor})
    with pytest.raises(ValueError, match=rf"checkpoint tensor 'model.layers.0.self_attn.k_scale'.*{error}"):
        LLM(str(path), registry=registry, kv_cache_dtype="fp8_e4m3")


def test_fp8_generation_leaves_every_page_free(make_llm) -> None:
    """Abort mid-prefill and finish the rest over an FP8 cache: exact accounting (make_llm checks it after)."""
    llm = make_llm(kv_cache_dtype="fp8_e4m3", chunked_prefill_size=16, num_pages=200)
    sched = llm.scheduler
    reqs = [sched.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in random_prompts([50, 8], 512)]
    sched.step()
    sched.abort(reqs[0].rid)
    while sched.has_work:
        sched.step()
        llm.check_accounting()
    assert reqs[1].finish_reason == "length" and len(reqs[1].output_ids) == 12


def test_fp32_reciprocal_is_float32_division() -> None:
    """The reciprocal the quantizing stores multiply by is float32's own 1 / scale, for any scale."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.cat([torch.rand(2000, generator=gen) * 10 + 1e-3, torch.tensor([1.0, 0.1, 3.0, 448.0])])
    for s in scales.tolist():
        want = (torch.tensor(1.0) / torch.tensor(s, dtype=torch.float32)).item()
        assert fp32_reciprocal(s) == want, s
        assert torch.tensor(fp32_reciprocal(s), dtype=torch.float32).item() == fp32_reciprocal(s)


@pytest.mark.parametrize("scale", [1.0, 0.37, 2.5])
def test_quantize_kv_rounds_the_scaled_values_to_nearest_and_clamps(scale: float) -> None:
    fp8 = torch.float8_e4m3fn
    x = (torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 500).to(torch.bfloat16)
    got = quantize_kv(x, scale, fp8)
    assert got.dtype == fp8 and not got.float().isnan().any()
    scaled = x.float() * fp32_reciprocal(scale)
    assert torch.equal(got.float(), scaled.clamp(-448, 448).to(fp8).float())
    assert got.float().abs().max() == 448  # some values were past the range
    # Round to nearest: no representable e4m3 value lies between a value and its quantization.
    err = (got.float() - scaled.clamp(-448, 448)).abs()
    ulp = torch.where(got.float().abs() >= 2**-6, 2.0 ** (torch.floor(torch.log2(got.float().abs())) - 3), 2.0**-9)
    assert (err <= ulp / 2 + 1e-12).all()


def test_quantize_kv_e5m2_rounds_to_nearest_and_clamps() -> None:
    """Into e5m2 (2 mantissa bits, +-57,344): the same rule, the format's own range."""
    fp8 = torch.float8_e5m2
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 30000
    got = quantize_kv(x, 0.5, fp8)
    scaled = x * fp32_reciprocal(0.5)
    assert torch.equal(got.float(), scaled.clamp(-57344, 57344).to(fp8).float())
    assert got.float().abs().max() == 57344 and not got.float().isnan().any()
    err = (got.float() - scaled.clamp(-57344, 57344)).abs()
    ulp = torch.where(got.float().abs() >= 2**-14, 2.0 ** (torch.floor(torch.log2(got.float().abs())) - 2), 2.0**-16)
    assert (err <= ulp / 2 + 1e-12).all()


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_a_quantized_pool_stores_exactly_quantize_kv(fp8: torch.dtype) -> None:
    """MHAKVPool over float8 stores through the kernel set's store_kv_quantized: quantize_kv's bytes."""
    layout = KVLayout(2, 8, 4, 2, 16, fp8, torch.device("cpu"), None, (0.5, 1.0), (2.0, 1.0))
    pool = MHAKVPool(layout)
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(5, 2, 16, generator=gen) * 300, torch.randn(5, 2, 16, generator=gen)
    loc = torch.tensor([3, 9, 0, 31, 17])
    pool.store_kv(k, v, loc, 0)
    k_rows = pool.k_cache(0).reshape(-1, 2, 16)[loc].view(torch.uint8)
    v_rows = pool.v_cache(0).reshape(-1, 2, 16)[loc].view(torch.uint8)
    assert layout.quantized
    assert torch.equal(k_rows, quantize_kv(k, 0.5, fp8).view(torch.uint8))
    assert torch.equal(v_rows, quantize_kv(v, 2.0, fp8).view(torch.uint8))
    assert pool.k_cache(1).view(torch.uint8).eq(0).all()  # the other layer untouched
