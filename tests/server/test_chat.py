"""``minisgl chat`` driven through a pseudo-terminal."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>> "


def ask(child: object, text: str) -> str:
    child.sendline(text)  # type: ignore[attr-defined]
    child.expect_exact(PROMPT, timeout=180)  # type: ignore[attr-defined]
    # The terminal echoes the line typed; the reply follows it.
    out = child.before.replace("\r\n", "\n")  # type: ignore[attr-defined]
    echoed, _, reply = out.partition("\n")
    assert echoed.strip() == text
    return reply.strip()


def test_chat_answers_keeps_history_and_resets(tiny_model: Path) -> None:
    from minisgl import LLM, SamplingParams

    env = {k: v for k, v in os.environ.items() if not k.startswith("MINISGL_")}
    args = ["-m", "minisgl", "chat", "--model", str(tiny_model), "--temperature", "0", "--max-tokens", "8",
            "--max-model-len", "256", "--num-pages", "64"]  # fmt: skip
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=180)
    try:
        child.expect_exact(PROMPT)
        assert "/reset" in child.before and "/exit" in child.before
        first = ask(child, "hello")
        second = ask(child, "hello")  # sees the first exchange in its prompt
        assert ask(child, "/reset") == "(conversation cleared)"
        third = ask(child, "hello")
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=60)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0

    # The first reply is what the engine gives for that conversation, in-process.
    with LLM(str(tiny_model), max_model_len=256, num_pages=64) as llm:
        tok = llm.tokenizer
        one = [{"role": "user", "content": "hello"}]
        greedy = SamplingParams(temperature=0, max_tokens=8)

        def reply(conversation: list[dict[str, str]]) -> str:
            text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
            return llm.generate([ids], greedy, use_tqdm=False)[0].text

        expected = reply(one)
        expected2 = reply([*one, {"role": "assistant", "content": expected}, {"role": "user", "content": "hello"}])
    assert first == expected.strip()
    assert second == expected2.strip()  # the history was used
    assert third == first  # /reset forgot it
