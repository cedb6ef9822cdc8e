"""Whole-model GPU checks of the FP8 KV cache: flashinfer over an FP8 cache against the torch reference over
the same FP8 cache (prefill logits, greedy decode with and without CUDA graphs, prefix reuse), and the page
count doubling against bfloat16. Skipped without CUDA (and without flashinfer).

The torch reference reads every prompt back from the FP8 cache, so the comparisons with it run flashinfer the
same way (``MINISGL_FLASHINFER_RAGGED=0``); by default flashinfer prefills fresh prompts over their own,
unquantized K/V, which is checked against the reference over a bfloat16 cache.
"""

from __future__ import annotations

import gc
import importlib.util
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.testing.models import prefill_logits, random_prompts, save_tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"),
]
pytest.importorskip("minisgl_plugin_llama", reason="the GPU engine tests use the llama-family plugin's models")

NEW_TOKENS = 24
MODELS = {  # flashinfer's head dims, GQA 2:1 and 4:1
    "Qwen3ForCausalLM": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128},
    "LlamaForCausalLM": {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64},
}
TIE = 0.05  # a greedy divergence is accepted where the reference prefers its token by < TIE row std


@pytest.fixture(autouse=True)
def _paged_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """flashinfer reads prompts back from the FP8 cache, as the torch reference does (a test may set it back)."""
    monkeypatch.setenv("MINISGL_FLASHINFER_RAGGED", "0")


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(request.param, path, max_position_embeddings=2048, **MODELS[request.param])
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts([5, 17, 300, 64, 9, 128, 33, 250, 1, 700], 512, seed=31)


def _llm(path: Path, **kw: object) -> LLM:
    kw = {"device": "cuda", "dtype": "bfloat16", "max_running_requests": 16, "chunked_prefill_size": 256, **kw}
    return LLM(str(path), **kw)  # type: ignore[arg-type]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.check_accounting()
    assert llm.kv_pages_in_use == 0
    return [o.token_ids for o in outs]


def _logits(llm: LLM, seqs: list[list[int]]) -> torch.Tensor:
    return prefill_logits(llm, seqs)


@dataclass
class Reference:
    prompts: list[list[int]]
    tokens: list[list[int]]
    llm: LLM  # torch attention over an FP8 cache, kept open to score continuations


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompts: list[list[int]]) -> Iterator[Reference]:
    llm = _llm(model_dir, attention_backend="torch", kv_cache_dtype="fp8_e4m3", overlap_schedule=False)
    assert llm.engine.kv_pool.layout.dtype == torch.float8_e4m3fn and llm.engine.graphs is None
    yield Reference(prompts, _generate(llm, prompts), llm)
    llm.close()


def _check_divergences(ref: Reference, tokens: list[list[int]], label: str) -> None:
    """Every sequence equals the reference's up to a near-tie of the reference (or entirely)."""
    diverged = []
    for i, (got, want) in enumerate(zip(tokens, ref.tokens, strict=True)):
        j = next((k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if j is not None:
            diverged.append((i, j, got[j]))
    if not diverged:
        return
    seqs = [ref.prompts[i] + ref.tokens[i][:j] for i, j, _ in diverged]
    logits = _logits(ref.llm, seqs)
    ends = list(itertools.accumulate(len(s) for s in seqs))
    for (i, j, tok), end in zip(diverged, ends, strict=True):
        row = logits[end - 1]
        margin = float(row[ref.tokens[i][j]] - row[tok])
        assert margin <= TIE * float(row.std()), (
            f"{label}: sequence {i} diverges at token {j} where the reference prefers its token by {margin:.4f} "
            f"(> {TIE} x std {float(row.std()):.3f})"
        )


def test_prefill_logits_close_to_torch_fp8(model_dir: Path, reference: Reference) -> None:
    seqs = [p + t for p, t in zip(reference.prompts, reference.tokens, strict=True)]
    ref = _logits(reference.llm, seqs)
    llm = _llm(model_dir, attention_backend="flashinfer", kv_cache_dtype="fp8_e4m3", cuda_graph_max_bs=0)
    assert type(llm.engine.attn).__name__ == "FlashInferAttnBackend"
    got = _logits(llm, seqs)
    llm.close()
    assert not torch.isnan(got).any()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 2e-2, f"relative logits error {rel:.2e} (flashinfer FP8 against torch FP8)"
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > TIE * ref.std(dim=-1)
    top1 = float((got.argmax(-1) == ref.argmax(-1))[decisive].float().mean())
    assert top1 >= 0.99, f"top-1 agreement at decisive positions {top1:.4f}"


def test_fresh_prompts_attend_over_their_unquantized_kv(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the ragged prefill on, a batch of fresh prompts over an FP8 cache gives the logits of attention over a
    bfloat16 cache (nothing is read back quantized), closer to them than the paged prefill over the FP8 cache; and
    the engine then decodes from what it stored."""
    seqs = random_prompts([5, 17, 200, 64, 9, 128, 33, 250], 512, seed=7)
    bf16 = _llm(model_dir, attention_backend="torch", overlap_schedule=False, cuda_graph_max_bs=0)
    ref = _logits(bf16, seqs)
    bf16.close()
    errors = {}
    for ragged in ("1", "0"):
        monkeypatch.setenv("MINISGL_FLASHINFER_RAGGED", ragged)
        llm = _llm(model_dir, attention_backend="flashinfer", kv_cache_dtype="fp8_e4m3")
        assert llm.engine.attn.ragged_prefill == (ragged == "1")  # type: ignore[attr-defined]
        got = _logits(llm, seqs)
        assert not torch.isnan(got).any()
        errors[ragged] = float((got - ref).norm() / ref.norm())
        if ragged == "1":
            tokens = _generate(llm, seqs)
            assert all(len(t) == NEW_TOKENS for t in tokens)
        llm.close()
    assert errors["1"] < 2e-2, f"relative logits error {errors['1']:.2e} against torch over a bfloat16 cache"
    assert errors["0"] > 2 * errors["1"], f"the paged prefill over FP8 is as close ({errors}): did ragged run?"


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_fp8_greedy_agrees_with_torch_fp8(
    model_dir: Path, reference: Reference, graphs: bool, page_size: int
) -> None:
    llm = _llm(
        model_dir,
        attention_backend="flashinfer",
        kv_cache_dtype="fp8",
        page_size=page_size,
        cuda_graph_max_bs=16 if graphs else 0,
    )
    assert (llm.engine.graphs is not None) == graphs
    tokens = _generate(llm, reference.prompts)
    llm.close()
    assert all(len(t) == NEW_TOKENS for t in tokens)
    _check_divergences(reference, tokens, f"graphs={graphs} page_size={page_size}")


def test_prefix_reuse_over_fp8_cache(model_dir: Path, reference: Reference) -> None:
    """The second pass over the same prompts reads their cached FP8 prefixes (radix cache) and decodes the same."""
    pytest.importorskip("minisgl_plugin_radix", reason="prefix reuse needs the radix cache plugin")
    llm = _llm(model_dir, attention_backend="flashinfer", kv_cache_dtype="fp8_e4m3", prefix_cache="radix")
    assert llm.engine.graphs is not None
    first = _generate(llm, reference.prompts)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(reference.prompts, params, use_tqdm=False)
    llm.check_accounting()
    cached = sum(o.cached_tokens for o in outs)
    llm.close()
    assert cached >= sum(len(p) // 16 * 16 for p in reference.prompts) - 16 * len(outs), cached
    _check_divergences(reference, first, "radix, first pass")
    _check_divergences(reference, [o.token_ids for o in outs], "radix, prefixes reused")


def test_e5m2_cache_greedy_agrees_with_torch_e5m2(model_dir: Path, prompts: list[list[int]]) -> None:
    """``kv_cache_dtype="fp8_e5m2"``: flashinfer with CUDA graphs (and the radix cache's prefixes on a second
    pass, where the plugin is installed) against the torch reference over an e5m2 cache."""
    ref_llm = _llm(model_dir, attention_backend="torch", kv_cache_dtype="fp8_e5m2", overlap_schedule=False)
    try:
        assert ref_llm.engine.kv_pool.layout.dtype == torch.float8_e5m2
        ref = Reference(prompts, _generate(ref_llm, prompts), ref_llm)
        radix = importlib.util.find_spec("minisgl_plugin_radix") is not None
        llm = _llm(model_dir, attention_backend="flashinfer", kv_cache_dtype="fp8_e5m2",
                   prefix_cache="radix" if radix else "naive")  # fmt: skip
        assert llm.engine.graphs is not None and llm.engine.kv_pool.k_cache(0).dtype == torch.float8_e5m2
        first, second = _generate(llm, prompts), _generate(llm, prompts)
        llm.close()
        _check_divergences(ref, first, "e5m2")
        _check_divergences(ref, second, "e5m2, second pass" + (" (prefixes reused)" if radix else ""))
    finally:
        ref_llm.close()


def test_fp8_cache_holds_twice_the_pages_of_bfloat16(model_dir: Path) -> None:
    """The same share of GPU memory gives twice the pages (the benchmark target, checked at start-up)."""
    pages = {}
    for kv in ("auto", "fp8_e4m3"):
        gc.collect()
        torch.cuda.empty_cache()
        llm = _llm(
            model_dir,
            attention_backend="flashinfer",
            kv_cache_dtype=kv,
            mem_fraction=0.01,
            max_running_requests=4096,
            cuda_graph_max_bs=0,
        )
        pages[kv] = llm.engine.kv_pool.layout.num_pages
        llm.close()
        del llm
    ratio = pages["fp8_e4m3"] / pages["auto"]
    print(
        f"RESULT KV pages at mem_fraction 0.01: bfloat16 {pages['auto']}, fp8_e4m3 {pages['fp8_e4m3']} ({ratio:.3f}x)"
    )
    assert 1.9 <= ratio <= 2.1, pages
