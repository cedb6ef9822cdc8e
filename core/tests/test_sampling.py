"""Sampling behaviour, checked against exact references."""

from __future__ import annotations

import pytest
import torch

from minisgl import SamplingParams
from minisgl.testing.models import random_prompts

PROMPTS = random_prompts([6, 30, 90, 12], 512, seed=7)


def _greedy(make_llm, **extra):  # type: ignore[no-untyped-def]
    llm = make_llm()
    return llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **extra), use_tqdm=False)


def _reference(hf_model, prompt: list[int], steps: int, penalize) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy decoding with transformers' logits and a penalty applied in plain Python."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf_model(torch.tensor([ids])).logits[0, -1].clone()
            penalize(logits, prompt, out)
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
    return out


def test_seeded_sampling_is_reproducible_and_batch_independent(make_llm) -> None:
    llm = make_llm()
    params = [
        SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=16, ignore_eos=True) for i in range(len(PROMPTS))
    ]
    first = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    second = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert first == second
    alone = llm.generate([PROMPTS[2]], params[2], use_tqdm=False)[0].token_ids
    assert alone == first[2]  # same seed, different batch: same tokens
    other = llm.generate([PROMPTS[2]], SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True))
    assert other[0].token_ids != first[2]


def test_unseeded_sampling_differs_between_calls(make_llm) -> None:
    llm = make_llm()
    params = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    a = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    b = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert a != b


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0, "top_k": 1},
        {"temperature": 1.3, "top_p": 1e-6},
        {"temperature": 1.3, "min_p": 1.0},
    ],
    ids=["top_k=1", "tiny-top_p", "min_p=1"],
)
def test_filters_that_leave_one_token_equal_greedy(make_llm, params) -> None:
    greedy = [o.token_ids for o in _greedy(make_llm)]
    llm = make_llm()
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True, **params), use_tqdm=False)
    assert [o.token_ids for o in out] == greedy


def test_top_k_restricts_choices(make_llm, hf_model) -> None:
    """With top_k=3 every sampled token is among the 3 most likely under the model."""
    llm = make_llm()
    prompt = PROMPTS[1]
    out = llm.generate([prompt], SamplingParams(temperature=5.0, top_k=3, seed=5, max_tokens=12, ignore_eos=True))
    ids = list(prompt)
    with torch.no_grad():
        for tok in out[0].token_ids:
            top3 = hf_model(torch.tensor([ids])).logits[0, -1].topk(3).indices.tolist()
            assert tok in top3
            ids.append(tok)


def test_repetition_penalty_matches_reference(make_llm, hf_model) -> None:
    def penalize(logits, prompt, out):  # type: ignore[no-untyped-def]
        for t in set(prompt) | set(out):
            logits[t] = logits[t] / 1.5 if logits[t] > 0 else logits[t] * 1.5

    out = _greedy(make_llm, repetition_penalty=1.5)
    for prompt, o in zip(PROMPTS[:2], out[:2]):
        assert o.token_ids == _reference(hf_model, prompt, 20, penalize)


def test_frequency_and_presence_penalties_match_reference(make_llm, hf_model) -> None:
    def penalize(logits, prompt, out):  # type: ignore[no-untyped-def]
        for t in set(out):
            logits[t] -= 0.8 * out.count(t) + 0.5

    out = _greedy(make_llm, frequency_penalty=0.8, presence_penalty=0.5)
    for prompt, o in zip(PROMPTS[:2], out[:2]):
        assert o.token_ids == _reference(hf_model, prompt, 20, penalize)


def test_logprobs_match_transformers(make_llm, hf_model) -> None:
    llm = make_llm()
    prompt = PROMPTS[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))[0]
    assert len(out.logprobs) == 6
    ids = list(prompt)
    with torch.no_grad():
        for tok, lp in zip(out.token_ids, out.logprobs):
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1], dim=-1)
            assert lp.token_id == tok
            assert lp.logprob == pytest.approx(float(ref[tok]), abs=1e-4)
            vals, idx = ref.topk(3)
            assert [t for t, _ in lp.top] == idx.tolist()
            assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-4)
            ids.append(tok)


def test_max_tokens_is_respected(make_llm) -> None:
    llm = make_llm()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 3, 17, 40)]
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [1, 3, 17, 40]
    assert all(o.finish_reason == "length" for o in out)


def test_stop_token_ids_end_generation(make_llm) -> None:
    full = _greedy(make_llm)[1].token_ids
    stop = full[5]
    first = full.index(stop)
    llm = make_llm()
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]))[0]
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop"


def test_stop_strings_cut_text_exactly(make_llm) -> None:
    full = _greedy(make_llm)[2]
    words = full.text.split(" ")
    stop = " ".join(words[4:6])  # a two-word stop string from the middle
    llm = make_llm()
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=20, stop=[stop, "never-there"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) == 6
