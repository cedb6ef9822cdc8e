"""Scheduling policy: prefill chunks mixed into decode steps, admission on a growth estimate, preemption and
recompute, and the step trace."""

from __future__ import annotations

import json

import pytest

from minisgl import SamplingParams
from minisgl.core import ValidationError
from minisgl.testing.models import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _run(llm, prompts, params, *, check_every_step: bool = True) -> list[list[int]]:  # type: ignore[no-untyped-def]
    sched = llm.scheduler
    plist = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [sched.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
    while sched.has_work:
        sched.step()
        if check_every_step:
            llm.check_accounting()
    return [list(r.output_ids) for r in reqs]


# ---------------------------------------------------------------------- mixed prefill + decode
def _long_prompt_steps(llm) -> tuple[list, list, list]:  # type: ignore[no-untyped-def]
    """Three streams decode; then a 300-token prompt arrives. Every step's batch, the streams, the long one."""
    sched = llm.scheduler
    # The streams outlast the long prompt's chunks.
    stream_params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    streams = [sched.add_request(p, stream_params) for p in random_prompts([6, 9, 12], 512, seed=11)]
    while any(not r.output_ids for r in streams):
        sched.step()
    long = sched.add_request(random_prompts([300], 512, seed=12)[0], GREEDY)
    batches = []
    original = sched._launch

    def spy(batch, before_sample):  # type: ignore[no-untyped-def]
        batches.append([(r, r.device_len - r.cached_len, r.is_decoding) for r in batch.reqs])
        return original(batch, before_sample)

    sched._launch = spy
    while not long.output_ids:
        sched.step()
    while sched.has_work:
        sched.step()
    return batches, streams, [long]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_long_prompt_does_not_stop_running_streams(make_llm, overlap: bool) -> None:
    llm = make_llm(chunked_prefill_size=32, overlap_schedule=overlap)
    batches, streams, (long,) = _long_prompt_steps(llm)
    chunks = [b for b in batches if any(r is long and not dec for r, _, dec in b)]
    assert len(chunks) == -(-300 // 32)  # the prompt in 10 chunks of at most 32 tokens
    for batch in chunks:
        prompt_tokens = sum(n for r, n, dec in batch if not dec)
        assert prompt_tokens <= 32
        decoding = {r.rid for r, n, dec in batch if dec and n == 1}
        assert decoding == {r.rid for r in streams}, "a running stream was left out of a step with a prompt chunk"
    assert [len(r.output_ids) for r in [*streams, long]] == [48, 48, 48, GREEDY.max_tokens]


def test_mixed_steps_give_the_outputs_of_prefill_first_steps(make_llm) -> None:
    prompts = random_prompts([6, 9, 12, 300, 40], 512, seed=13)
    outs = {}
    for mixed in (True, False):
        llm = make_llm(chunked_prefill_size=32, mixed_prefill=mixed, max_running_requests=4)
        outs[mixed] = _run(llm, prompts, GREEDY)
    assert outs[True] == outs[False]


def test_prefill_first_policy_pauses_streams(make_llm) -> None:
    """The policy switch is real: with mixed_prefill off, the chunk steps decode nothing."""
    llm = make_llm(chunked_prefill_size=32, mixed_prefill=False)
    batches, _, (long,) = _long_prompt_steps(llm)
    chunks = [b for b in batches if any(r is long and not dec for r, _, dec in b)]
    assert chunks and all(all(not dec for _, _, dec in b) for b in chunks)


# ---------------------------------------------------------------------- the throughput policy
def _steps(llm, prompts, params) -> tuple[list[list[int]], list[tuple[int, int]]]:  # type: ignore[no-untyped-def]
    """:func:`_run`, also giving each step's (decodes, prompt tokens)."""
    sched = llm.scheduler
    steps: list[tuple[int, int]] = []
    original = sched._launch

    def spy(batch, before_sample):  # type: ignore[no-untyped-def]
        prompt = sum(r.device_len - r.cached_len for r in batch.reqs if not r.is_decoding)
        steps.append((sum(1 for r in batch.reqs if r.is_decoding), prompt))
        return original(batch, before_sample)

    sched._launch = spy
    return _run(llm, prompts, params), steps


# One long request and eight short ones with longer prompts, as a batch job brings them.
PACE_PROMPTS = random_prompts([8, 40, 40, 40, 40, 40, 40, 40, 40], 512, seed=41)
PACE_PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (60, 6, 8, 10, 12, 6, 8, 10, 12)]


def test_fcfs_is_the_default_policy(make_llm) -> None:
    assert make_llm().config.schedule_policy == "fcfs"


def test_an_unknown_policy_is_refused_by_name(make_llm) -> None:
    with pytest.raises(ValidationError, match="schedule_policy.*'fcfs' or 'throughput'"):
        make_llm(schedule_policy="lof")


def test_throughput_policy_admits_the_longest_requests_first(make_llm) -> None:
    prompts = random_prompts([5, 6, 7, 8], 512, seed=42)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5, 7)]
    ends = {}
    for policy in ("fcfs", "throughput"):
        sched = make_llm(schedule_policy=policy, max_running_requests=1).scheduler
        order = []
        reqs = [sched.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        while sched.has_work:
            order += [e.req.rid for e in sched.step() if e.finished]
        ends[policy] = [next(i for i, r in enumerate(reqs) if r.rid == rid) for rid in order]
    assert ends["fcfs"] == [0, 1, 2, 3]
    assert ends["throughput"] == [1, 3, 2, 0]  # 9, 7, 5, 3 tokens


@pytest.mark.parametrize("overlap", [True, False])
def test_throughput_policy_paces_prompts_into_decode_steps(make_llm, overlap: bool) -> None:
    """The short requests' prompts are computed beside the long one's decodes, a few per step, not all in the
    first step; the outputs are those of arrival order, and the job takes no more steps than it."""
    kw = {"chunked_prefill_size": 512, "throughput_step_tokens": 16, "overlap_schedule": overlap}
    outs, steps = {}, {}
    for policy in ("fcfs", "throughput"):
        outs[policy], steps[policy] = _steps(make_llm(schedule_policy=policy, **kw), PACE_PROMPTS, PACE_PARAMS)
    assert outs["throughput"] == outs["fcfs"]
    total = sum(len(p) for p in PACE_PROMPTS)
    assert steps["fcfs"][0][1] == total  # arrival order: every prompt in the first step
    first_prompt = steps["throughput"][0][1]
    assert 8 <= first_prompt <= 16, steps["throughput"][:3]  # the long request, then fill to 16 tokens
    with_prompt = [s for s in steps["throughput"] if s[1]]
    assert len(with_prompt) >= total // 16, steps["throughput"]
    assert all(dec + prompt <= 16 for dec, prompt in steps["throughput"][1:] if prompt), steps["throughput"]
    assert len(steps["throughput"]) <= len(steps["fcfs"]) + 1


def test_throughput_policy_fills_the_rows_a_padded_step_computes_anyway(make_llm) -> None:
    """Where a step pads to a prefill graph's size (here: a multiple of 24 tokens), the paced prompt tokens fill
    the padding: every step with prompt tokens, but the one that runs out of them, has a padded size."""
    kw = {"chunked_prefill_size": 512, "throughput_step_tokens": 16}
    want, _ = _steps(make_llm(schedule_policy="fcfs", **kw), PACE_PROMPTS, PACE_PARAMS)
    llm = make_llm(schedule_policy="throughput", **kw)
    assert llm.engine.prefill_step_tokens(17) == 17  # CPU: no prefill graphs, no padding
    llm.engine.prefill_step_tokens = lambda n: -(-n // 24) * 24  # type: ignore[method-assign]
    got, steps = _steps(llm, PACE_PROMPTS, PACE_PARAMS)
    assert got == want
    with_prompt = [dec + prompt for dec, prompt in steps if prompt]
    assert with_prompt and all(n % 24 == 0 for n in with_prompt[:-1]), steps
    assert all(n <= 24 for n in with_prompt[:-1]), steps  # the target of 16 pads to 24, no further


def test_throughput_policy_computes_more_to_keep_the_longest_requests_pace(make_llm) -> None:
    """Where filling the steps would start a request too late to end with the longest one, the step computes
    more prompt tokens: the job still ends when its longest request does."""
    prompts = random_prompts([4] + [60] * 6, 512, seed=43)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 20, 20, 20, 20, 20, 20)]
    kw = {"chunked_prefill_size": 512, "throughput_step_tokens": 2, "max_running_requests": 8}
    outs, fcfs = _steps(make_llm(schedule_policy="fcfs", **kw), prompts, params)
    paced_outs, paced = _steps(make_llm(schedule_policy="throughput", **kw), prompts, params)
    assert paced_outs == outs
    assert max(prompt for _, prompt in paced[1:]) > 2  # past the step target, for the deadlines
    assert len(paced) <= len(fcfs) + 1


def test_throughput_policy_with_preemption_gives_the_same_outputs(make_llm) -> None:
    reference = _run(make_llm(schedule_policy="fcfs"), PREEMPT_PROMPTS, PREEMPT_PARAMS_MIXED, check_every_step=False)
    llm = _preempting(make_llm, schedule_policy="throughput", throughput_step_tokens=4)
    assert _run(llm, PREEMPT_PROMPTS, PREEMPT_PARAMS_MIXED) == reference
    assert llm.scheduler.stats["preemptions"] > 0


# ---------------------------------------------------------------------- admission and preemption
PREEMPT_PROMPTS = random_prompts([12, 5, 20, 9, 16, 7], 512, seed=21)
PREEMPT_PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PREEMPT_PARAMS_MIXED = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (16, 9, 14, 6, 16, 11)]


def _preempting(make_llm, **kwargs):  # type: ignore[no-untyped-def]
    """A pool of 16 pages of 4 tokens, where the requests' worst case needs 41, and no growth reserved."""
    return make_llm(page_size=4, num_pages=17, admit_reserve_tokens=0, chunked_prefill_size=16, **kwargs)


@pytest.mark.parametrize("overlap", [True, False])
def test_preempted_requests_give_the_outputs_of_an_unpreempted_run(make_llm, overlap: bool) -> None:
    reference = _run(make_llm(overlap_schedule=overlap), PREEMPT_PROMPTS, PREEMPT_PARAMS, check_every_step=False)
    llm = _preempting(make_llm, overlap_schedule=overlap)
    assert _run(llm, PREEMPT_PROMPTS, PREEMPT_PARAMS) == reference
    assert llm.scheduler.stats["preemptions"] > 0
    assert llm.scheduler.kv.reserved_pages == 0


def test_seeded_penalised_and_logprob_requests_survive_preemption(make_llm) -> None:
    """Seeded noise depends on the request's own step count, penalties on its output: recompute changes neither."""
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=16, ignore_eos=True, logprobs=1)
        if i % 2
        else SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=16, ignore_eos=True)
        for i in range(len(PREEMPT_PROMPTS))
    ]
    reference = _run(make_llm(), PREEMPT_PROMPTS, params, check_every_step=False)
    llm = _preempting(make_llm)
    assert _run(llm, PREEMPT_PROMPTS, params) == reference
    assert llm.scheduler.stats["preemptions"] > 0


def test_abort_of_a_preempted_request_returns_everything(make_llm) -> None:
    llm = _preempting(make_llm)
    sched = llm.scheduler
    reqs = [sched.add_request(p, PREEMPT_PARAMS) for p in PREEMPT_PROMPTS]
    while not any(r.preemptions for r in reqs):
        sched.step()
    victim = next(r for r in reqs if r.preemptions and not r.is_finished)
    assert sched.abort(victim.rid) is victim
    llm.check_accounting()
    while sched.has_work:
        sched.step()
        llm.check_accounting()
    assert victim.finish_reason == "abort"
    assert all(len(r.output_ids) == 16 for r in reqs if r is not victim)


def test_a_small_request_is_answered_while_long_default_length_requests_run(make_llm) -> None:
    """Requests without max_tokens (they may run to the context length) no longer reserve all of it: a short
    request arriving behind three of them finishes while they still run."""
    llm = make_llm(page_size=4, num_pages=1 + 300, max_model_len=512, admit_reserve_tokens=16)
    sched = llm.scheduler
    open_ended = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    longs = [sched.add_request(p, open_ended) for p in random_prompts([20, 30, 40], 512, seed=31)]
    # Each of them could grow to 512 tokens (128 pages): the worst case of all three is 384 pages, over 300.
    for _ in range(4):
        sched.step()
    small = sched.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for _ in range(40):
        sched.step()
        llm.check_accounting()
        if small.is_finished:
            break
    assert small.is_finished and len(small.output_ids) == 4
    assert sched.num_running == 3 and not any(r.is_finished for r in longs)
    for r in longs:
        sched.abort(r.rid)


def test_worst_case_reservation_never_preempts(make_llm) -> None:
    llm = make_llm(page_size=4, num_pages=17, admit_reserve_tokens=1 << 20, chunked_prefill_size=16)
    _run(llm, PREEMPT_PROMPTS, PREEMPT_PARAMS)
    assert llm.scheduler.stats["preemptions"] == 0


# ---------------------------------------------------------------------- the step trace
TRACE_KEYS = {
    "step", "t", "kind", "reqs", "prefill_reqs", "decode_reqs", "tokens", "prefill_tokens", "running", "waiting",
    "free_pages", "reserved_pages", "host_ms", "gpu_ms", "gap_ms", "events",
}  # fmt: skip


def test_step_trace_has_a_header_and_one_line_per_step(make_llm, tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    llm = make_llm(chunked_prefill_size=32, trace_steps=str(path))
    sched = llm.scheduler
    launched = []
    original = sched._launch
    sched._launch = lambda batch, before: (launched.append(batch), original(batch, before))[1]  # type: ignore[method-assign]
    _long_prompt_steps(llm)
    sched.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    head, steps = lines[0], lines[1:]
    assert head["trace"] == "minisgl-steps" and head["version"] == 1
    assert head["page_size"] == 4 and head["chunked_prefill_size"] == 32 and head["num_pages"] > 0
    assert len(steps) == len(launched)
    assert [s["step"] for s in steps] == list(range(len(steps)))
    for s, batch in zip(steps, launched, strict=True):
        assert set(s) >= TRACE_KEYS
        assert s["reqs"] == batch.size == s["prefill_reqs"] + s["decode_reqs"]
        assert s["tokens"] == s["prefill_tokens"] + s["decode_reqs"]
        assert s["gpu_ms"] is not None and s["gpu_ms"] >= 0 and s["host_ms"] >= 0
    kinds = [s["kind"] for s in steps]
    assert kinds[0] == "prefill" and "decode" in kinds
    mixed = [s for s in steps if s["kind"] == "mixed"]
    assert len(mixed) == 10 and all(s["decode_reqs"] == 3 and 0 < s["prefill_tokens"] <= 32 for s in mixed)
    assert sum(s["prefill_tokens"] for s in mixed) == 300


def test_step_trace_reports_preemptions(make_llm, tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    llm = _preempting(make_llm, trace_steps=str(path))
    _run(llm, PREEMPT_PROMPTS, PREEMPT_PARAMS, check_every_step=False)
    preemptions = llm.scheduler.stats["preemptions"]
    llm.scheduler.close()
    steps = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    noted = sum(int(e.split(":")[1]) for s in steps for e in s["events"] if e.startswith("preempt:"))
    assert noted == preemptions > 0


def test_step_trace_to_an_unwritable_path_is_a_clear_error(make_llm, tmp_path) -> None:
    missing = tmp_path / "no-such-folder" / "steps.jsonl"
    with pytest.raises(ValidationError, match=r"trace_steps: cannot open '.*steps.jsonl' for appending"):
        make_llm(trace_steps=str(missing))
