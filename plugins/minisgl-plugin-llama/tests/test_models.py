"""Llama-family models against transformers, token for token (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.core import Batch
from minisgl.testing.models import hf_greedy, random_prompts

LENGTHS = [5, 17, 300, 64, 9, 128, 33, 250]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def references(tiny_model) -> dict[str, list[list[int]]]:
    arch, _, model = tiny_model
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=1)
    return {"prompts": prompts, "outputs": hf_greedy(model, prompts, NEW_TOKENS)}


@pytest.mark.parametrize(
    ("page_size", "chunk"),
    [(1, 512), (16, 512), (16, 100), (1, 37)],
    ids=["page1", "page16", "page16-chunked", "page1-chunked"],
)
def test_greedy_matches_transformers(tiny_model, references, page_size: int, chunk: int) -> None:
    _, path, _ = tiny_model
    with LLM(str(path), page_size=page_size, chunked_prefill_size=chunk, max_running_requests=8) as llm:
        outs = llm.generate(
            references["prompts"], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        )
        assert [o.token_ids for o in outs] == references["outputs"]
        assert all(o.finish_reason == "length" for o in outs)
        llm.check_accounting()
        assert llm.kv_pages_in_use == 0


def test_prefill_logits_match_transformers(tiny_model) -> None:
    _, path, model = tiny_model
    prompts = random_prompts([7, 40, 129], model.config.vocab_size, seed=3)
    with LLM(str(path), page_size=16) as llm:
        sched = llm.scheduler
        reqs = [sched.add_request(p, SamplingParams(max_tokens=1)) for p in prompts]
        for r in reqs:
            assert sched.kv.try_admit(r)
            r.device_len = r.prompt_len
        batch = Batch(reqs, "prefill", sample_mask=[True] * len(reqs))
        logits = llm.engine.prefill_logits(batch, sched._prepare(batch))
        start = 0
        for p in prompts:
            with torch.no_grad():
                ref = model(torch.tensor([p])).logits[0]
            got = logits[start : start + len(p)]
            start += len(p)
            assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()
        for r in reqs:
            sched.waiting.remove(r)
            sched.kv.release(r)
        sched.kv.check_accounting([])


def test_mixed_batch_and_staggered_arrivals(tiny_model, references) -> None:
    """Requests added while others decode give the same tokens as a single batch."""
    _, path, _ = tiny_model
    prompts, expected = references["prompts"], references["outputs"]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(path), page_size=4, chunked_prefill_size=64, max_running_requests=3) as llm:
        sched = llm.scheduler
        reqs = [sched.add_request(prompts[0], params)]
        pending = list(prompts[1:])
        while any(not r.is_finished for r in reqs) or pending:
            sched.step()
            if pending and len(reqs) < 8:
                reqs.append(sched.add_request(pending.pop(0), params))
        assert [r.output_ids for r in reqs] == expected
        llm.check_accounting()
