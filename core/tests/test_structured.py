"""Structured output in the core: the grammar backend a scheduler gets (a plugin component kind) and the
plain-PyTorch mask. The xgrammar backend's own tests are in plugins/minisgl-plugin-xgrammar."""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.core import LOGPROB_FLOOR, Req
from minisgl.engine.grammar import BaseGrammarBackend, TokenMask, make_grammar_backend
from minisgl.engine.sampling import Sampler
from minisgl.plugins import (
    GrammarBackendSpec,
    PluginRegistry,
    PluginSource,
    UnknownComponentError,
    Unsupported,
    hookimpl,
    load_plugins,
)


class RecordingBackend(BaseGrammarBackend):
    """Remembers how it was built; compiles nothing."""

    def __init__(self, tokenizer: Any, vocab_size: int, device: torch.device, **kwargs: Any) -> None:
        self.built_with = (tokenizer, vocab_size, device, kwargs)

    def compile(self, kind: str, text: str) -> Any:
        return (kind, text)

    def matcher(self, compiled: Any) -> Any:
        return compiled

    def fill(self, matchers: Sequence[tuple[int, Any]], n: int) -> TokenMask | None:
        return None


@hookimpl
def minisgl_grammar_backends() -> list[GrammarBackendSpec]:
    return [GrammarBackendSpec(name="recording", factory=RecordingBackend, auto=True)]


@pytest.fixture
def llm(make_llm: Callable[..., LLM]) -> LLM:
    return make_llm(max_running_requests=8)


def _engine(llm: LLM, *, with_backend: bool = False, plugin: object = None, **config: Any) -> Any:
    """``llm``'s engine as make_grammar_backend reads it: with the recording backend (this module's hook), or
    the grammar plugin ``plugin``, installed, or neither."""
    registry: PluginRegistry = llm.engine.registry
    if with_backend:
        plugin = sys.modules[__name__]
    if plugin is not None:
        source = PluginSource("grammar-test", plugin)
        registry = load_plugins(only=["builtin", "grammar-test"], extra=[source], environ={})
    eng = llm.engine
    cfg = eng.config.with_changes(**config)
    return types.SimpleNamespace(config=cfg, registry=registry, device=eng.device, hf_config=eng.hf_config)


def test_without_a_backend_grammars_are_refused_naming_the_plugin(llm: LLM) -> None:
    assert llm.engine.registry.names("grammar") == []
    backend, why = make_grammar_backend(llm.engine, object(), [2])
    assert backend is None and "grammar backend plugin" in why and "minisgl-plugin-xgrammar" in why


@pytest.mark.parametrize("name", ["auto", "recording"])
def test_the_backend_is_built_for_the_scheduler(llm: LLM, name: str) -> None:
    tokenizer = object()
    backend, why = make_grammar_backend(_engine(llm, with_backend=True, grammar_backend=name), tokenizer, [2])
    assert isinstance(backend, RecordingBackend) and why == ""
    vocab = int(llm.engine.hf_config.vocab_size)
    assert backend.built_with == (tokenizer, vocab, llm.engine.device, {"stop_token_ids": [2], "max_rows": 8})


def test_without_a_tokenizer_grammars_are_refused(llm: LLM) -> None:
    backend, why = make_grammar_backend(_engine(llm, with_backend=True), None, [2])
    assert backend is None and why == "structured output needs a tokenizer; this engine has none"


@pytest.mark.parametrize("with_backend", [True, False])
def test_a_backend_that_is_not_installed_fails_even_without_a_tokenizer(llm: LLM, with_backend: bool) -> None:
    engine = _engine(llm, with_backend=with_backend, grammar_backend="xgrammar")
    with pytest.raises(UnknownComponentError, match="unknown grammar backend 'xgrammar'"):
        make_grammar_backend(engine, None, [2])


class _MissingLibrary:
    """A plugin whose grammar backend is installed but cannot run: its library is missing."""

    @staticmethod
    def _check(device: str) -> bool:
        raise Unsupported("the grammarlib library is not installed; pip install grammarlib")

    @hookimpl
    def minisgl_grammar_backends(self) -> list[GrammarBackendSpec]:
        return [GrammarBackendSpec(name="broken", factory=RecordingBackend, auto=True, is_supported=self._check)]


def test_auto_serves_without_grammars_when_no_installed_backend_runs(
    llm: LLM, caplog: pytest.LogCaptureFixture
) -> None:
    """A grammar plugin without its library must not stop the server: grammars are refused, saying why."""
    backend, why = make_grammar_backend(_engine(llm, plugin=_MissingLibrary(), grammar_backend="auto"), object(), [2])
    assert backend is None
    assert "grammar backend 'broken'" in why and "pip install grammarlib" in why
    assert "structured output is off" in caplog.text and "pip install grammarlib" in caplog.text


def test_a_named_backend_that_cannot_run_fails_saying_why(llm: LLM) -> None:
    with pytest.raises(UnknownComponentError, match="does not support device.*pip install grammarlib"):
        make_grammar_backend(_engine(llm, plugin=_MissingLibrary(), grammar_backend="broken"), object(), [2])


def test_the_mask_holds_on_transposed_logits() -> None:
    """CPU matmuls can return the logits column-major (seen with 32 rows): the mask must still hold."""
    vocab, n = 1000, 6
    bitmask = torch.zeros(n, (vocab + 31) // 32, dtype=torch.int32)
    bitmask[:, 0] = 1 << 7  # only token 7 allowed on the constrained rows
    bitmask[:, -1] = -1  # and the last 8 (the top bit is the sign bit)
    logits = torch.randn(vocab, n).t()  # non-contiguous rows
    assert not logits.is_contiguous()
    logits[:, 992:] = -100.0  # below every other logit: the mask leaves them only token 7 to beat
    reqs = [Req(rid=i, input_ids=[1], params=SamplingParams(temperature=0), max_new_tokens=1) for i in range(n)]
    free = logits.argmax(dim=1).tolist()
    tokens = Sampler(torch.device("cpu")).sample(logits, reqs, TokenMask(bitmask, [0, 2, 4])).tokens.tolist()
    assert tokens[0::2] == [7, 7, 7]
    assert tokens[1::2] == free[1::2]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_under_a_mask_list_only_allowed_tokens(temperature: float) -> None:
    """Masked-out tokens (-inf) are never alternatives, and every logprob is a finite number (valid JSON)."""
    vocab = 64
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) | (1 << 9)  # row 0: tokens 3 and 9 only
    bitmask[1, 0] = 0  # row 1: nothing allowed (a grammar at a dead end)
    params = SamplingParams(temperature=temperature, seed=1, logprobs=5)
    reqs = [Req(rid=i, input_ids=[1], params=params, max_new_tokens=1) for i in range(3)]
    result = Sampler(torch.device("cpu")).sample(torch.randn(3, vocab), reqs, TokenMask(bitmask, [0, 1]))
    first, dead, free = result.logprobs
    assert first is not None and dead is not None and free is not None
    assert first.token_id in (3, 9) and sorted(t for t, _ in first.top) == [3, 9]
    assert all(math.isfinite(v) for _, v in first.top) and math.isfinite(first.logprob)
    assert dead.top == [] and dead.logprob == LOGPROB_FLOOR
    assert len(free.top) == 5 and all(math.isfinite(v) for _, v in free.top)
