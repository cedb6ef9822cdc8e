"""Prefill CUDA graphs (``cuda_graph_max_tokens``): prefill and mixed steps replay their work outside attention.

Against the same engine run eagerly (``cuda_graph_max_tokens=0``): prefill logits of batches of many shapes
(one token, sizes on and off the captured token counts, several requests, a prefix served from the cache), the
greedy tokens of a run full of mixed steps, tensor-parallel-free models of two families, both attention
backends; and the step trace marks the steps too large for the graphs. Skipped without CUDA.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.testing.models import prefill_logits, random_prompts, save_tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("minisgl_plugin_llama", reason="the tests use the llama-family plugin's models")
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
_NEEDS_FLASHINFER = pytest.mark.skipif(not HAS_FLASHINFER, reason="no flashinfer")
# (backend, KV cache dtype): flashinfer stores K/V inside the graphs' pieces (supports_attend_stored), over a
# bf16 and over an FP8 cache; the torch reference through its forward between them.
BACKENDS = [
    pytest.param(("torch", "auto"), id="torch"),
    pytest.param(("flashinfer", "auto"), id="flashinfer", marks=_NEEDS_FLASHINFER),
    pytest.param(("flashinfer", "fp8_e4m3"), id="flashinfer-fp8kv", marks=_NEEDS_FLASHINFER),
]
MODELS = {
    "Qwen3ForCausalLM": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128},
    "LlamaForCausalLM": {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64},
}
MAX_TOKENS = 512  # the largest captured token count in these tests


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(request.param, path, max_position_embeddings=2048, num_hidden_layers=3, **MODELS[request.param])
    return path


def _llm(path: Path, attn: str, max_tokens: int, **kw: object) -> LLM:
    kw = {"max_running_requests": 16, "chunked_prefill_size": 512, **kw}
    return LLM(  # type: ignore[arg-type]
        str(path), device="cuda", dtype="bfloat16", attention_backend=attn, cuda_graph_max_tokens=max_tokens, **kw
    )


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[tuple[LLM, LLM]]:
    """The same model with prefill graphs and without."""
    attn, kv_dtype = request.param
    if kv_dtype != "auto" and not model_dir.name.startswith("Qwen3"):
        pytest.skip("the FP8 cache through the graphs: one model is enough (each head size compiles its kernels)")
    graphs = _llm(model_dir, attn, MAX_TOKENS, kv_cache_dtype=kv_dtype)
    eager = _llm(model_dir, attn, 0, kv_cache_dtype=kv_dtype)
    assert graphs.engine.prefill_graphs is not None and eager.engine.prefill_graphs is None
    assert (graphs.engine.prefill_graphs.kv_pool is not None) == (attn == "flashinfer")
    assert graphs.engine.prefill_graphs.max_tokens == MAX_TOKENS  # below chunked_prefill + running (528)
    yield graphs, eager
    graphs.close()
    eager.close()


def _close(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    assert got.shape == want.shape, label
    assert torch.isfinite(got).all(), label
    rel = float((got - want).norm() / want.norm())
    # Only the GEMMs' row counts differ (padded to the captured size), which may change cuBLAS's kernel choice
    # and so the last bits of a bf16 result; a wrong buffer, layer order or stale input is off by O(1).
    assert rel < 1e-2, f"{label}: relative logits error {rel:.2e} between graph replay and eager"
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    assert agree > 0.97, f"{label}: top-1 agreement {agree:.3f}"


@pytest.mark.parametrize(
    "lengths",
    [[1], [15], [16], [17], [255, 2], [100, 1, 37, 64], [300, 200], [512], [600]],
    ids=lambda ls: "+".join(map(str, ls)),
)
def test_prefill_logits_match_eager(pair: tuple[LLM, LLM], lengths: list[int]) -> None:
    graphs, eager = pair
    seqs = random_prompts(lengths, 512, seed=sum(lengths))
    calls = []
    runner = graphs.engine.prefill_graphs
    assert runner is not None
    replay = runner.replay
    runner.replay = lambda batch: calls.append(batch) or replay(batch)  # type: ignore[method-assign]
    try:
        got = prefill_logits(graphs, seqs)
    finally:
        del runner.replay
    want = prefill_logits(eager, seqs)
    total = sum(lengths)
    assert len(calls) == (1 if total <= MAX_TOKENS else 0), f"{total} tokens: {len(calls)} replays"
    assert graphs.engine.last_launch_replayed == (total <= MAX_TOKENS)
    _close(got, want, f"lengths {lengths}")
    # The same batch again: the graphs hold no state of the last replay.
    _close(prefill_logits(graphs, seqs), want, f"lengths {lengths}, replayed twice")


def test_greedy_with_mixed_steps_matches_eager(pair: tuple[LLM, LLM]) -> None:
    """Prompts arriving while others decode (16 running, 512-token chunks): mixed steps of decode tokens and
    prompt chunks, prefix reuse (every prompt shares a 40-token head), all through the graphs."""
    graphs, eager = pair
    head = random_prompts([40], 512, seed=3)[0]
    prompts = [head + p for p in random_prompts([5, 300, 17, 90, 1, 250, 64, 9, 128, 33, 400, 2] * 2, 512, seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runner = graphs.engine.prefill_graphs
    assert runner is not None
    mixed = []
    replay = runner.replay
    runner.replay = lambda b: mixed.append(any(r.is_decoding for r in b.reqs)) or replay(b)  # type: ignore[method-assign]
    try:
        got = [o.token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    finally:
        del runner.replay
    want = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert sum(mixed) >= 3, f"only {sum(mixed)} mixed steps replayed graphs: the test does not test them"
    for llm in (graphs, eager):
        llm.check_accounting()
        assert llm.kv_pages_in_use == 0
    pairs = [(a, b) for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=True)]
    same = sum(a == b for a, b in pairs) / len(pairs)
    # A random tiny model in bf16 has near-ties that the last bits of a GEMM can flip; then a sequence differs
    # from there on. Most must match exactly.
    exact = sum(x == y for x, y in zip(got, want, strict=True))
    assert exact >= len(prompts) * 3 // 4 and same > 0.9, f"{exact}/{len(prompts)} sequences equal, {same:.3f} tokens"


def test_throughput_policy_paces_prompts_through_the_graphs(pair: tuple[LLM, LLM], model_dir: Path) -> None:
    """schedule_policy throughput: the queue longest first, a few prompt tokens per step beside the decodes, all
    replayed from the graphs; the tokens are those of arrival order (same near-tie tolerance as above)."""
    graphs, _ = pair
    paced = _llm(model_dir, graphs.config.attention_backend, MAX_TOKENS, schedule_policy="throughput",
                 throughput_step_tokens=64, kv_cache_dtype=graphs.config.kv_cache_dtype)  # fmt: skip
    prompts = random_prompts([5, 300, 17, 90, 1, 250, 64, 9, 128, 33, 400, 2], 512, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 8, 12, 30, 6, 10) * 2]
    runner = paced.engine.prefill_graphs
    assert runner is not None
    steps: list[tuple[int, int]] = []
    replay = runner.replay

    def spy(b):  # type: ignore[no-untyped-def]
        steps.append((sum(r.is_decoding for r in b.reqs), sum(r.extend_len for r in b.reqs if not r.is_decoding)))
        return replay(b)

    runner.replay = spy  # type: ignore[method-assign]
    try:
        got = [o.token_ids for o in paced.generate(prompts, params, use_tqdm=False)]
    finally:
        del runner.replay
    want = [o.token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    paced.check_accounting()
    assert paced.kv_pages_in_use == 0
    paced.close()
    mixed = [s for s in steps if s[0]]
    assert len(mixed) >= 10, f"{len(mixed)} mixed steps replayed: the prompts were not paced"
    pairs = [(a, b) for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=True)]
    same = sum(a == b for a, b in pairs) / len(pairs)
    exact = sum(x == y for x, y in zip(got, want, strict=True))
    assert [len(x) for x in got] == [p.max_tokens for p in params]
    assert exact >= len(prompts) * 3 // 4 and same > 0.9, f"{exact}/{len(prompts)} sequences equal, {same:.3f} tokens"


def test_trace_marks_steps_past_the_graphs(model_dir: Path, tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    llm = _llm(model_dir, "torch", 64, trace_steps=str(trace), chunked_prefill_size=256)
    assert llm.engine.prefill_graphs is not None and llm.engine.prefill_graphs.max_tokens == 64
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(random_prompts([20], 512, seed=1), params, use_tqdm=False)  # 20 tokens: replayed
    llm.generate(random_prompts([200], 512, seed=2), params, use_tqdm=False)  # 200 tokens: eager
    llm.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    header, steps = lines[0], [line for line in lines[1:] if line.get("kind") in ("prefill", "mixed")]
    assert header.get("prefill_graph_max_tokens") == 64, header
    events = [step.get("events", []) for step in steps]
    assert [e for e in events if any(x.startswith("prefill_eager") for x in e)] == [["prefill_eager:tokens=200"]]


@pytest.mark.skipif(not HAS_FLASHINFER, reason="no flashinfer")
def test_chunks_launched_ahead_of_a_busy_device(model_dir: Path) -> None:
    """One long prompt in 32-token chunks with nothing else running: the chunks sample nothing, so the host
    launches them without waiting for the device, and with the device kept busy first, it launches all of
    them before the first runs. The tokens equal those of the same run with the device keeping up (a backend
    that reuses a host buffer per step, as FlashInfer's plans do, must not let a later step overwrite it)."""
    llm = _llm(model_dir, "flashinfer", MAX_TOKENS, chunked_prefill_size=32, prefix_cache="naive")
    prompts = random_prompts([300, 200], 512, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        torch.cuda.synchronize()
        torch.cuda._sleep(300_000_000)  # the device busy for a while before the first chunk
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.check_accounting()
        assert llm.kv_pages_in_use == 0
    finally:
        llm.close()
    assert got == want
