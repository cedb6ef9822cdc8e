"""The GPU-oriented engine features that also run (and must be right) on CPU.

Overlap scheduling launches batch N+1 before reading batch N's tokens; on
CPU the same code path runs, so its bookkeeping is checked here against
lock-step scheduling and transformers. Also: graph batch sizes and prefill graph token counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.engine.graph import graph_batch_sizes, graph_token_sizes
from minisgl.plugins import PluginRegistry
from minisgl.testing.models import hf_greedy, random_prompts, save_tiny_model

NEW = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, registry: PluginRegistry) -> Tiny:
    path = tmp_path_factory.mktemp("llama")
    model = save_tiny_model("LlamaForCausalLM", path)
    prompts = random_prompts([5, 40, 3, 77, 12, 9], 512, seed=5)
    return Tiny(path, prompts, hf_greedy(model, prompts, NEW), registry)


@dataclass
class Tiny:
    path: Path
    prompts: list[list[int]]
    ref: list[list[int]]
    registry: PluginRegistry  # conftest's: built-ins plus the core test model


def _llm(t: Tiny, **kw: object) -> LLM:
    return LLM(str(t.path), registry=t.registry, **kw)  # type: ignore[arg-type]


def _run(t: Tiny, params: SamplingParams | list[SamplingParams], **kw: object) -> LLM:
    prompts = t.prompts
    llm = _llm(t, page_size=4, chunked_prefill_size=32, max_running_requests=4, **kw)
    llm.outputs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]
    return llm


def test_overlap_matches_transformers_and_lockstep(tiny) -> None:
    ref = tiny.ref
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for overlap in (True, False):
        llm = _run(tiny, params, overlap_schedule=overlap)
        assert llm.scheduler.overlap is overlap
        assert [o.token_ids for o in llm.outputs] == ref
        llm.check_accounting()
        assert llm.kv_pages_in_use == 0
        llm.close()


def test_overlap_stops_on_stop_token_like_lockstep(tiny) -> None:
    """A request that stops on a token in batch N is already in batch N+1: its extra token is dropped."""
    ref = tiny.ref
    # Stop each request on its own 4th greedy token: it must end right there, with reason "stop".
    params = [SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[r[3]]) for r in ref]
    results = {}
    for overlap in (True, False):
        llm = _run(tiny, params, overlap_schedule=overlap)
        results[overlap] = [(o.token_ids, o.finish_reason) for o in llm.outputs]
        llm.check_accounting()
        assert llm.kv_pages_in_use == 0
        llm.close()
    assert results[True] == results[False]
    for (tokens, reason), r in zip(results[True], ref, strict=True):
        assert tokens == r[: r.index(r[3]) + 1] and reason == "stop"


def test_penalties_switch_to_lockstep_and_match(tiny) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, repetition_penalty=1.3)
    outs = {}
    for overlap in (True, False):
        llm = _run(tiny, params, overlap_schedule=overlap)
        outs[overlap] = [o.token_ids for o in llm.outputs]
        assert llm.scheduler._lockstep_reqs == 0  # every request finished and was uncounted
        llm.close()
    assert outs[True] == outs[False]


def test_abort_while_a_batch_is_in_flight(tiny) -> None:
    ref = tiny.ref
    llm = _llm(tiny, page_size=4, max_running_requests=4, overlap_schedule=True)
    sched = llm.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    reqs = [sched.add_request(p, params) for p in tiny.prompts[:3]]
    for _ in range(4):
        sched.step()
    assert sched._inflight is not None
    victim = reqs[1]
    assert sched.abort(victim.rid) is victim and victim.finish_reason == "abort"
    while sched.has_work:
        sched.step()
    assert reqs[0].output_ids == ref[0] and reqs[2].output_ids == ref[2]
    assert len(victim.output_ids) < NEW
    llm.check_accounting()
    assert llm.kv_pages_in_use == 0
    llm.close()


def test_overlap_follows_the_config_only(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP", "1")  # no longer read
    for overlap in (True, False):
        with _llm(tiny, overlap_schedule=overlap) as llm:
            assert llm.scheduler.overlap is overlap


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and len(sizes) == 35


def test_graph_token_sizes() -> None:
    assert graph_token_sizes(0) == []
    assert graph_token_sizes(16) == [16]
    assert graph_token_sizes(40) == [16, 32, 40]
    sizes = graph_token_sizes(4096)
    assert sizes[:3] == [16, 32, 48] and sizes[-1] == 4096 and sizes == sorted(set(sizes))
    assert len(sizes) == 48 and sizes[15:18] == [256, 288, 320] and sizes[-2] == 3840
    # A batch pads to the next size: past 128 tokens by at most an eighth of it.
    for n in range(129, 4097, 7):
        padded = next(s for s in sizes if s >= n)
        assert padded - n <= n / 8, (n, padded)
    assert graph_token_sizes(5000)[-3:] == [4096, 4608, 5000]


def test_no_prefill_graphs_on_cpu(tiny: Tiny) -> None:
    with _llm(tiny) as llm:
        assert llm.engine.prefill_graphs is None and llm.engine.graphs is None
        llm.generate(tiny.prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        assert llm.engine.last_launch_replayed is False
