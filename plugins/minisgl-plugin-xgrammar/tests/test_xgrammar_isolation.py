"""One request's grammar never stalls the others: compiles run off the step loop in a child process bounded in
time and memory, and a mask that takes too long ends its own request (on the demo model, CPU)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import xgrammar
from minisgl_plugin_xgrammar.compile_process import CompileProcess, CompileRefused
from xgrammar_demo import demo_llm

from minisgl import LLM, SamplingParams
from minisgl.core import ReqStatus, ValidationError

# A short schema whose compile takes many seconds (a long bounded repetition) ...
SLOW_SCHEMA = json.dumps({"type": "string", "pattern": "[a-z]{1,12000}"})
# ... and an ambiguous grammar whose masks get slower with every character it matches.
AMBIGUOUS = 'root ::= s\ns ::= s s s s | s s s | s s | "a" | "b" | ""'


def _deep_items(levels: int) -> str:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with demo_llm(
        max_running_requests=8, grammar_compile_timeout=2.0, grammar_compile_memory=512, grammar_mask_timeout=0.05
    ) as model:
        yield model


@pytest.fixture(autouse=True)
def _accounting(llm: LLM) -> Iterator[None]:
    yield
    assert not llm.scheduler.live_requests()
    llm.check_accounting()
    assert llm.kv_pages_in_use == 0


def _run_until_refused(llm: LLM, grammar: tuple[str, str]) -> tuple[ValidationError, int, Any]:
    """Add a free request and a constrained one; step until the constrained one is refused. The error, the
    steps that gave the free request tokens while the grammar compiled, and the free request."""
    sched = llm.scheduler
    free = sched.add_request(llm.encode("Count to a hundred:"), SamplingParams(max_tokens=2000, ignore_eos=True))
    bad = sched.add_request(llm.encode("A string:"), SamplingParams(max_tokens=8, grammar=grammar))
    assert bad.status is ReqStatus.COMPILING
    steps_while_compiling = 0
    refused: list[ValidationError] = []
    while not refused:
        events = sched.step()
        if bad.status is ReqStatus.COMPILING and any(e.req is free for e in events):
            steps_while_compiling += 1
        refused += [err for req, err in sched.take_grammar_outcomes() if req is bad and err is not None]
    sched.abort(free.rid)
    while sched.has_work:
        sched.step()
    return refused[0], steps_while_compiling, free


def test_a_slow_compile_is_refused_at_its_time_limit_while_others_decode(llm: LLM) -> None:
    error, steps, free = _run_until_refused(llm, ("json_schema", SLOW_SCHEMA))
    assert error.field == "response_format"
    assert "took longer than 2 s" in error.message and "--grammar-compile-timeout" in error.message
    assert steps >= 5, steps  # the free request kept decoding while the grammar compiled
    backend = llm.scheduler.grammar
    assert backend is not None and backend._process is not None
    with pytest.raises(ProcessLookupError):  # killed (and reaped): it computes nothing more
        os.kill(backend._process.killed[-1], 0)


def test_a_compile_past_its_memory_limit_is_refused(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = llm.scheduler.grammar
    assert backend is not None
    # Deep nesting grows the compile's memory steadily (hundreds of MiB over tens of seconds): with a small
    # memory limit and a long time limit, the memory limit is the one it meets, in a few seconds.
    limits = dataclasses.replace(backend.limits, compile_seconds=120.0, compile_memory_bytes=40 * 2**20)
    monkeypatch.setattr(backend, "limits", limits)
    error, steps, _ = _run_until_refused(llm, ("json_schema", _deep_items(900)))
    assert error.field == "response_format"
    assert "needed more than 40 MiB" in error.message and "--grammar-compile-memory" in error.message
    assert steps >= 5, steps


def test_after_a_killed_compile_the_next_grammar_compiles(llm: LLM) -> None:
    _run_until_refused(llm, ("json_schema", SLOW_SCHEMA))
    out = llm.generate(["Yes or no?"], SamplingParams(max_tokens=8, grammar=("regex", "(yes|no)")), use_tqdm=False)
    assert out[0].text in ("yes", "no") and out[0].finish_reason == "stop"


def test_the_compile_process_compiles_and_goes_with_close(llm: LLM) -> None:
    backend = llm.scheduler.grammar
    assert backend is not None
    process = CompileProcess(backend._tokenizer_info().serialize_json(), threads=1)
    try:
        serialized = process.compile("regex", "[0-9]{1,3}", seconds=60, memory=None)
        assert xgrammar.CompiledGrammar.deserialize_json(serialized, backend._tokenizer_info()) is not None
        with pytest.raises(CompileRefused, match="unclosed|Expect|paren|\\)"):
            process.compile("regex", "(unclosed", seconds=60, memory=None)
        child = process._proc
        assert child is not None and child.poll() is None  # one child serves every compile
    finally:
        process.close()
    assert child.poll() is not None
    with pytest.raises(RuntimeError, match="closed"):
        process.compile("regex", "a", seconds=60, memory=None)


def test_a_slow_mask_ends_its_request_with_grammar_error_and_the_batch_goes_on(llm: LLM) -> None:
    sched = llm.scheduler
    eos = llm.eos_token_ids
    free = sched.add_request(llm.encode("Count to a hundred:"), SamplingParams(max_tokens=300, ignore_eos=True))
    # End-of-text banned: the reply only grows, and with it the cost of each mask of the ambiguous grammar.
    bias = {int(t): -100.0 for t in eos}
    slow = sched.add_request(
        llm.encode("Letters:"), SamplingParams(max_tokens=2000, grammar=("ebnf", AMBIGUOUS), logit_bias=bias)
    )
    while sched.has_work:
        sched.step()
        sched.take_grammar_outcomes()
    assert slow.finish_reason == "grammar_error", (slow.finish_reason, len(slow.output_ids))
    assert 0 < len(slow.output_ids) < 2000
    assert set(llm.tokenizer.decode(slow.output_ids, skip_special_tokens=True)) <= {
        "a",
        "b",
    }  # what it gave before was constrained
    assert free.finish_reason == "length" and len(free.output_ids) == 300


def test_a_cached_grammar_is_queued_at_once(llm: LLM) -> None:
    sched = llm.scheduler
    grammar = ("regex", "(red|green|blue)")
    llm.generate(["A colour:"], SamplingParams(max_tokens=4, grammar=grammar), use_tqdm=False)
    req = sched.add_request(llm.encode("Another colour:"), SamplingParams(max_tokens=4, grammar=grammar))
    assert req.status is ReqStatus.WAITING  # no compile, no wait for the grammar thread
    while sched.has_work:
        sched.step()
    assert sched.take_grammar_outcomes() == []
    assert llm.tokenizer.decode(req.output_ids, skip_special_tokens=True) in ("red", "green", "blue")


def test_close_ends_a_compile_under_way(llm: LLM) -> None:
    """Closing (the scheduler's close at shutdown) kills the child at once, not after the compile's time limit."""
    import threading

    backend = llm.scheduler.grammar
    assert backend is not None
    process = CompileProcess(backend._tokenizer_info().serialize_json(), threads=1)
    process.compile("regex", "a", seconds=60, memory=None)  # started and warm
    errors: list[BaseException] = []

    def slow() -> None:
        try:
            process.compile("json_schema", SLOW_SCHEMA, seconds=60, memory=None)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.5)
    child = process._proc
    process.close()
    thread.join(5)  # the compile alone takes 10 s and more
    assert not thread.is_alive() and errors and isinstance(errors[0], RuntimeError)
    assert child is not None and child.poll() is not None
