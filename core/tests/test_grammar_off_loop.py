"""Grammars compile off the step loop and a late mask ends only its own request: the scheduler's side, with a
grammar backend whose timings the test decides (grammar_script_plugin.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grammar_script_plugin as script
import pytest

from minisgl import LLM, SamplingParams
from minisgl.core import ReqStatus, ValidationError
from minisgl.message import StepOutput
from minisgl.plugins import PluginSource, load_plugins
from minisgl.testing.registry import TEST_MODELS_PLUGIN, _test_models_plugin
from minisgl.tokenizer.detokenizer import DetokenizerService


@pytest.fixture
def llm(tiny_dir: Path) -> Iterator[LLM]:
    sources = [PluginSource(TEST_MODELS_PLUGIN, _test_models_plugin()), PluginSource("grammar-script", script)]
    registry = load_plugins(only=["builtin", TEST_MODELS_PLUGIN, "grammar-script"], extra=sources, environ={})
    script.GATE.clear()
    with LLM(
        str(tiny_dir),
        registry=registry,
        page_size=4,
        max_running_requests=8,
        grammar_compile_timeout=0.5,
        grammar_mask_timeout=0.05,
    ) as model:
        yield model
        script.release()
        assert not model.scheduler.live_requests()
        model.check_accounting()
        assert model.kv_pages_in_use == 0


FREE = SamplingParams(max_tokens=40, ignore_eos=True)


def _grammar(text: str, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=kwargs.pop("max_tokens", 8), ignore_eos=True, grammar=("regex", text), **kwargs)


def _drain(llm: LLM) -> list[Any]:
    outcomes = []
    while llm.scheduler.has_work:
        llm.scheduler.step()
        outcomes += llm.scheduler.take_grammar_outcomes()
    return outcomes


def test_a_compiling_request_waits_apart_while_the_others_decode(llm: LLM) -> None:
    sched = llm.scheduler
    free = sched.add_request([5, 6, 7], FREE)
    held = sched.add_request([8, 9], _grammar("hold:x"))
    assert held.status is ReqStatus.COMPILING and held not in sched.waiting
    for _ in range(5):
        sched.step()
    assert len(free.output_ids) >= 4 and not held.output_ids  # the others went on while it compiled
    assert held.status is ReqStatus.COMPILING and sched.take_grammar_outcomes() == []
    script.release()
    outcomes = _drain(llm)
    assert outcomes == [(held, None)]
    assert held.finish_reason == "length" and len(held.output_ids) == 8
    assert set(held.output_ids) <= set(script.ALLOWED)  # the mask of the grammar held
    assert free.finish_reason == "length"


@pytest.mark.parametrize(
    "text,message", [("bad", "this grammar is bad"), ("boom", "compiling the grammar failed: the backend broke")]
)
def test_a_grammar_that_fails_to_compile_is_refused_holding_nothing(llm: LLM, text: str, message: str) -> None:
    sched = llm.scheduler
    free = sched.add_request([5, 6, 7], FREE)
    bad = sched.add_request([8, 9], _grammar(text))
    outcomes = _drain(llm)
    assert [(r, e.field, e.message) for r, e in outcomes if e is not None] == [(bad, "grammar", message)]
    assert bad.is_finished and not bad.output_ids
    assert free.finish_reason == "length" and len(free.output_ids) == 40


def test_a_backend_that_overruns_its_compile_limit_is_given_up_on(llm: LLM) -> None:
    sched = llm.scheduler
    slow = sched.add_request([8, 9], _grammar("sleep:3"))
    start = time.monotonic()
    outcomes = _drain(llm)
    assert time.monotonic() - start < 2.9  # refused before the compile returned
    ((req, error),) = outcomes
    assert req is slow and "took longer than 0.5 s" in error.message and "--grammar-compile-timeout" in error.message


def test_aborting_a_compiling_request_drops_it(llm: LLM) -> None:
    sched = llm.scheduler
    held = sched.add_request([8, 9], _grammar("hold:y"))
    assert sched.abort(held.rid) is held and held.finish_reason == "abort"
    script.release()
    assert _drain(llm) == []
    assert not sched.live_requests()


def test_a_late_mask_ends_its_request_with_grammar_error_and_no_token(llm: LLM) -> None:
    sched = llm.scheduler
    free = sched.add_request([5, 6, 7], FREE)
    late = sched.add_request([8, 9], _grammar("late:3", max_tokens=20))
    ended = []
    while sched.has_work:
        ended += [e for e in sched.step() if e.req is late and e.finished]
        sched.take_grammar_outcomes()
    assert late.finish_reason == "grammar_error" and len(late.output_ids) == 3
    assert [(e.token, e.logprob) for e in ended] == [(None, None)]  # what was sampled for it is discarded
    assert free.finish_reason == "length" and len(free.output_ids) == 40


@pytest.mark.parametrize("accepted", [1, 2, 3, 5])
def test_a_late_mask_hands_the_prefix_cache_only_tokens_it_kept(llm: LLM, accepted: int) -> None:
    """With overlap the next step was already fed the late request's discarded token: its KV position is no
    token of the request, so what the prefix cache is given stops before it (a whole number of pages, one slot
    per token, whichever page that position falls on: prompt 2 + 1 or 5 accepted tokens + 1 fills one or two
    pages of 4)."""
    sched = llm.scheduler
    cache = sched.kv.cache
    inserts: list[tuple[int, int]] = []
    real_insert = cache.insert

    def insert(token_ids: Any, slots: Any) -> int:
        inserts.append((len(token_ids), slots.numel()))
        return real_insert(token_ids, slots)

    cache.insert = insert  # type: ignore[method-assign]
    late = sched.add_request([8, 9], _grammar(f"late:{accepted}", max_tokens=20))
    while sched.has_work:
        sched.step()
        sched.take_grammar_outcomes()
    assert late.finish_reason == "grammar_error" and len(late.output_ids) == accepted
    kept = (2 + accepted) // 4 * 4  # the whole pages of the tokens it has
    assert inserts == ([(kept, kept)] if kept else [])


def test_generate_raises_a_refusal_as_add_request_did(llm: LLM) -> None:
    with pytest.raises(ValidationError, match="this grammar is bad") as info:
        llm.generate([[5, 6, 7], [8, 9]], [FREE, _grammar("bad")], use_tqdm=False)
    assert info.value.field == "grammar"


def test_an_event_without_a_token_ends_the_stream_without_counting_one() -> None:
    service = DetokenizerService(None)
    service.process(StepOutput(accepted=[[1, 3, [], True, False]]))
    out, _ = service.process(StepOutput(rids=[1], tokens=[7]))
    assert out.counts == [1]
    out, _ = service.process(StepOutput(rids=[1], tokens=[-1], finished=[[0, "grammar_error", False, 0]]))
    assert out.counts == [1] and out.finished == [[0, "grammar_error", 3, 0]]
