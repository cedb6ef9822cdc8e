"""The demo model, SmolLM2-135M-Instruct, from its Q4_1 GGUF file."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(smollm2):
    with LLM(str(smollm2), page_size=16, max_running_requests=4, max_model_len=2048) as engine:
        yield engine


def _chat_prompt(llm: LLM, question: str) -> str:
    return llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def test_capital_of_france(llm: LLM) -> None:
    out = llm.generate(
        [_chat_prompt(llm, "What is the capital of France?")], SamplingParams(temperature=0, max_tokens=32)
    )
    assert "Paris" in out[0].text
    assert out[0].finish_reason == "stop"


def test_first_32_tokens_match_transformers(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    source = llm.engine.source
    assert source is not None
    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    prompt = _chat_prompt(llm, "Write a short poem about the sea.")
    ids = llm.tokenizer.encode(prompt)
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert out[0].token_ids == ref
