"""``minisgl chat`` driven through a pseudo-terminal."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import sys
import time
from pathlib import Path

PROMPT = ">>> "


class Terminal:
    """A child process on a pseudo-terminal (what a person at a keyboard would see and type)."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: become the program
            os.execvpe(args[0], args, env)
        self.buffer = ""

    def expect(self, text: str, timeout: float = 180) -> str:
        """Everything printed up to ``text`` (consumed)."""
        deadline = time.monotonic() + timeout
        while text not in self.buffer:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {text!r}; got {self.buffer!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    data = b""
                assert data, f"the program ended before printing {text!r}; got {self.buffer!r}"
                self.buffer += data.decode("utf-8", errors="replace")
        before, _, self.buffer = self.buffer.partition(text)
        return before.replace("\r\n", "\n")

    def sendline(self, text: str) -> None:
        os.write(self.fd, (text + "\n").encode())

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                self.pid = 0
                return os.waitstatus_to_exitcode(status)
            if select.select([self.fd], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):
                    os.read(self.fd, 4096)
        raise AssertionError("the program did not exit")

    def kill(self) -> None:
        if not self.pid:  # already reaped
            return
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def ask(term: Terminal, text: str) -> str:
    term.sendline(text)
    # The terminal echoes the line typed; the reply follows it.
    echoed, _, reply = term.expect(PROMPT).partition("\n")
    assert echoed.strip() == text
    return reply.strip()


def test_chat_answers_keeps_history_and_resets(tiny_model: Path) -> None:
    from minisgl import LLM, SamplingParams

    env = {k: v for k, v in os.environ.items() if not k.startswith("MINISGL_")}
    args = ["-m", "minisgl", "chat", "--model", str(tiny_model), "--temperature", "0", "--max-tokens", "8",
            "--max-model-len", "256", "--num-pages", "64"]  # fmt: skip
    term = Terminal([sys.executable, *args], env)
    try:
        banner = term.expect(PROMPT)
        assert "/reset" in banner and "/exit" in banner
        first = ask(term, "hello")
        second = ask(term, "hello")  # sees the first exchange in its prompt
        assert ask(term, "/reset") == "(conversation cleared)"
        third = ask(term, "hello")
        term.sendline("/exit")
        assert term.wait() == 0
    finally:
        term.kill()

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
