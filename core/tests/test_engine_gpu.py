"""Whole-model GPU checks: flashinfer against torch attention, CUDA graphs and overlap on and off.

A tiny random model decodes greedily in bf16 on the GPU with the ``torch``
attention backend (no graphs, no overlap: the reference) and with every
combination of the ``flashinfer`` backend, CUDA graphs and overlap
scheduling. Tokens must agree at >= 99% of positions and prefill logits must
be close. Skipped without CUDA (and the flashinfer ones without flashinfer).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.core import Batch
from minisgl.testing.models import random_prompts, save_tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("minisgl_plugin_llama", reason="the GPU engine tests use the llama-family plugin's models")
needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed")

NEW_TOKENS = 32
# Shapes flashinfer supports (head_dim 64/128), with GQA 2:1 and 4:1.
MODELS = {
    "Qwen3ForCausalLM": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128},
    "LlamaForCausalLM": {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64},
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(request.param, path, max_position_embeddings=2048, **MODELS[request.param])
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts([5, 17, 300, 64, 9, 128, 33, 250, 1, 700, 48, 90], 512, seed=11)


def _generate(path: Path, prompts: list[list[int]], **kw: object) -> tuple[list[list[int]], LLM]:
    kw = {"device": "cuda", "dtype": "bfloat16", "max_running_requests": 16, "chunked_prefill_size": 256, **kw}
    llm = LLM(str(path), **kw)  # type: ignore[arg-type]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False
    )
    llm.check_accounting()
    assert llm.kv_pages_in_use == 0
    return [o.token_ids for o in outs], llm


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    tokens, llm = _generate(model_dir, prompts, attention_backend="torch", overlap_schedule=False)
    assert llm.engine.graphs is None  # the torch backend has no graph hooks: eager decode
    llm.close()
    return tokens


@needs_flashinfer
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "lockstep"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_greedy_agrees_with_torch(
    model_dir: Path, prompts: list[list[int]], reference: list[list[int]], graphs: bool, overlap: bool, page_size: int
) -> None:
    tokens, llm = _generate(
        model_dir,
        prompts,
        attention_backend="flashinfer",
        page_size=page_size,
        cuda_graph_max_bs=16 if graphs else 0,
        overlap_schedule=overlap,
    )
    assert type(llm.engine.attn).__name__ == "FlashInferAttnBackend"
    assert (llm.engine.graphs is not None) == graphs
    assert llm.scheduler.overlap == overlap
    llm.close()
    assert all(len(t) == NEW_TOKENS for t in tokens)
    agree = _agreement(tokens, reference)
    assert agree >= 0.99, f"top-1 agreement with the torch backend {agree:.3f}"


@needs_flashinfer
@pytest.mark.parametrize("attn", ["flashinfer,torch", "torch,flashinfer", "auto"])
def test_hybrid_and_auto_backends(
    model_dir: Path, prompts: list[list[int]], reference: list[list[int]], attn: str
) -> None:
    tokens, llm = _generate(model_dir, prompts, attention_backend=attn)
    name = type(llm.engine.attn).__name__
    expected = {"auto": "FlashInferAttnBackend"}.get(attn, "HybridAttnBackend")
    assert name == expected
    # Graphs follow the decode backend: torch decode runs eagerly.
    assert (llm.engine.graphs is not None) == attn.endswith(("flashinfer", "auto"))
    llm.close()
    agree = _agreement(tokens, reference)
    assert agree >= 0.99, f"{attn}: top-1 agreement with the torch backend {agree:.3f}"


@needs_flashinfer
def test_prefill_logits_close_to_torch(model_dir: Path, prompts: list[list[int]]) -> None:
    logits = {}
    for attn in ("torch", "flashinfer"):
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", attention_backend=attn, cuda_graph_max_bs=0)
        sched = llm.scheduler
        reqs = [sched.add_request(p, SamplingParams(max_tokens=1)) for p in prompts[:6]]
        for r in reqs:
            assert llm.engine.kv.try_admit(r)
            r.device_len = r.prompt_len
        batch = Batch(reqs, "prefill", sample_mask=[True] * len(reqs))
        sched._prepare(batch)
        logits[attn] = llm.engine.prefill_logits(batch).float()
        for r in reqs:
            sched.waiting.remove(r)
            llm.engine.kv.release(r)
        llm.close()
    ref, got = logits["torch"], logits["flashinfer"]
    assert not torch.isnan(got).any()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 2e-2, f"relative logits error {rel:.2e}"
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert top1 >= 0.99, f"prefill top-1 agreement {top1:.3f}"


def test_dummy_weights_from_a_config_file(tmp_path: Path) -> None:
    """--load-format dummy with a model config: real shapes, random weights, no checkpoint."""
    import json

    from minisgl.testing.models import tiny_config

    cfg = tiny_config("Qwen3ForCausalLM", head_dim=64).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    llm = LLM("dummy-qwen3", device="cuda", load_format="dummy", model_config=str(path), cuda_graph_max_bs=4)
    assert llm.engine.source is None
    outs = llm.generate([[1, 2, 3]] * 3, SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [8, 8, 8]
    assert all(0 <= t < cfg["vocab_size"] for o in outs for t in o.token_ids)
    llm.check_accounting()
    llm.close()
