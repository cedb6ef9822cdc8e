"""A grammar backend whose timings the test decides (loaded as a plugin file: ``plugin_paths``), for the scheduler's
off-loop compiles and late masks. Grammar texts say what happens:

- ``hold:...``: compile waits until ``release()`` (or 30 s);
- ``sleep:S``: compile takes S seconds, ignoring the limit (the scheduler gives up on it);
- ``bad``: refused by the backend; ``boom``: the backend fails;
- ``late:N``: the mask is late (when a mask budget is set) once N tokens are accepted;
- anything else compiles at once. Every mask allows the tokens 3 to 9 only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from minisgl.core import ValidationError
from minisgl.engine.grammar import BaseGrammarBackend, TokenMask, error_field
from minisgl.plugins import GrammarBackendSpec, hookimpl

ALLOWED = range(3, 10)
GATE = threading.Event()


def release() -> None:
    GATE.set()


class Matcher:
    def __init__(self, text: str):
        self.text = text
        self.accepted: list[int] = []

    def accept_token(self, token: int) -> bool:
        self.accepted.append(token)
        return token in ALLOWED

    def is_terminated(self) -> bool:
        return False


class ScriptedBackend(BaseGrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, device: torch.device, **kwargs: Any):
        self.vocab_size = vocab_size
        self.device = device
        self.compiled: list[str] = []

    def compile(self, kind: str, text: str) -> Any:
        if text.startswith("hold:"):
            GATE.wait(30)
        elif text.startswith("sleep:"):
            time.sleep(float(text.split(":")[1]))
        elif text == "bad":
            raise ValidationError(error_field(kind), "this grammar is bad")
        elif text == "boom":
            raise RuntimeError("the backend broke")
        self.compiled.append(text)
        return text

    def matcher(self, compiled: Any) -> Any:
        return Matcher(compiled)

    def fill(self, matchers: Sequence[tuple[int, Any]], n: int) -> TokenMask | None:
        if not matchers:
            return None
        bitmask = torch.zeros(n, (self.vocab_size + 31) // 32, dtype=torch.int32)
        for t in ALLOWED:
            bitmask[:, t // 32] |= 1 << (t % 32)
        late = [
            row
            for row, m in matchers
            if self.limits.mask_seconds is not None
            and m.text.startswith("late:")
            and len(m.accepted) >= int(m.text.split(":")[1])
        ]
        rows = [row for row, _ in matchers if row not in late]
        return TokenMask(bitmask.to(self.device), rows, late)


@hookimpl
def minisgl_grammar_backends() -> list[GrammarBackendSpec]:
    return [GrammarBackendSpec(name="scripted", factory=ScriptedBackend, auto=True)]
