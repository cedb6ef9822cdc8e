"""The plugin's registration, the backend on a word-level tokenizer (no model needed) and its mask kernel."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading

import pytest
import torch
from minisgl_plugin_xgrammar.backend import XGrammarBackend, XGrammarMask

from minisgl.core import Req, SamplingParams, ValidationError
from minisgl.engine.grammar import GrammarLimits, TokenMask
from minisgl.engine.sampling import Sampler
from minisgl.plugins import PluginRegistry, UnknownComponentError, load_plugins
from minisgl.testing.models import save_word_tokenizer

VOCAB = 64  # tokens w3 .. w63 (ids 0-2 are special, 2 is the stop token)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def registry() -> PluginRegistry:
    return load_plugins(only=["builtin", "xgrammar"], environ={})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    return save_word_tokenizer(tmp_path_factory.mktemp("words"), VOCAB)


def _backend(registry: PluginRegistry, tokenizer: object, name: str = "auto") -> XGrammarBackend:
    backend = registry.pick("grammar", name, "cpu").build(tokenizer, VOCAB, CPU, stop_token_ids=[2], max_rows=4)
    assert isinstance(backend, XGrammarBackend)
    return backend


def _allowed(mask: TokenMask | None, n: int, row: int) -> list[int]:
    assert mask is not None
    logits = torch.zeros(n, VOCAB)
    mask.apply(logits)
    return (logits[row] == 0).nonzero().flatten().tolist()


def test_listed_and_picked_by_auto(registry: PluginRegistry, tokenizer: object) -> None:
    assert registry.provider("grammar", "xgrammar").distribution == "minisgl-plugin-xgrammar"
    assert [s.name for s in registry.ranked("grammar", "cpu")] == ["xgrammar"]
    assert _backend(registry, tokenizer).max_rows == 4
    assert _backend(registry, tokenizer, "xgrammar").stop_token_ids == [2]


def test_without_the_library_it_is_unsupported_saying_what_to_install(
    registry: PluginRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    find_spec = importlib.util.find_spec
    hidden = lambda name, *a: None if name == "xgrammar" else find_spec(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    reason = registry.get("grammar", "xgrammar").unsupported_reason("cpu")
    assert reason == "the xgrammar library is not installed; pip install 'xgrammar>=0.2.9'"
    assert registry.supported("grammar", "cpu") == []
    with pytest.raises(UnknownComponentError, match="pip install 'xgrammar"):
        registry.pick("grammar", "xgrammar", "cpu")


def test_loading_the_plugin_imports_no_xgrammar() -> None:
    code = (
        "import sys; from minisgl.plugins import load_plugins; load_plugins(only=['builtin', 'xgrammar']); "
        "print('xgrammar' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_masks_follow_the_matcher(registry: PluginRegistry, tokenizer: object) -> None:
    backend = _backend(registry, tokenizer)
    m = backend.matcher(backend.compile("regex", "w5(w7)*"))
    assert backend.fill([], 3) is None
    mask = backend.fill([(1, m)], 3)
    assert isinstance(mask, XGrammarMask) and mask.rows == [1]
    assert _allowed(mask, 3, 1) == [5] and _allowed(mask, 3, 0) == list(range(VOCAB))  # row 0 is free
    assert m.accept_token(5) and not m.is_terminated()
    assert _allowed(backend.fill([(0, m)], 1), 1, 0) == [2, 7]  # the stop token once the grammar may end
    assert m.accept_token(2) and m.is_terminated()


@pytest.mark.parametrize(
    "kind,text,field",
    [
        ("json_schema", "{not json", "response_format"),
        ("regex", "(unclosed", "grammar"),
        ("ebnf", "root ::= undefined_rule", "grammar"),
    ],
)
def test_a_bad_grammar_names_its_field(
    registry: PluginRegistry, tokenizer: object, kind: str, text: str, field: str
) -> None:
    with pytest.raises(ValidationError, match="invalid") as info:
        _backend(registry, tokenizer).compile(kind, text)
    assert info.value.field == field


def test_the_cache_is_a_bounded_lru(registry: PluginRegistry, tokenizer: object) -> None:
    backend = _backend(registry, tokenizer)
    first = backend.compile("regex", "w3")
    assert backend.compile("regex", "w3") is first
    for i in range(backend.cache_size):
        backend.compile("regex", f"w4{{{i + 1}}}")
    assert len(backend._cache) == backend.cache_size and ("regex", "w3") not in backend._cache


@pytest.mark.parametrize("width", [100, 130])  # the mask's 4 words cover 128 tokens: past them, logits stay
@pytest.mark.parametrize("mask_type", [TokenMask, XGrammarMask])
def test_the_kernel_and_the_core_reference_agree(mask_type: type[TokenMask], width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(5, width, generator=gen)
    expected = logits.clone()
    for row in (0, 3, 4):
        for tok in range(min(width, 128)):
            if not (int(bitmask[row, tok // 32]) >> (tok % 32)) & 1:
                expected[row, tok] = float("-inf")
    mask_type(bitmask, [0, 3, 4]).apply(logits)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("mask_type", [TokenMask, XGrammarMask])
def test_mask_applies_to_transposed_logits(mask_type: type[TokenMask]) -> None:
    """CPU matmuls can return the logits column-major (seen with 32 rows): the mask must still hold."""
    vocab, n = 1000, 6
    bitmask = torch.zeros(n, (vocab + 31) // 32, dtype=torch.int32)
    bitmask[:, 0] = 1 << 7  # only token 7 allowed on the constrained rows
    logits = torch.randn(vocab, n).t()  # non-contiguous rows
    assert not logits.is_contiguous()
    reqs = [Req(rid=i, input_ids=[1], params=SamplingParams(temperature=0), max_new_tokens=1) for i in range(n)]
    free = logits.argmax(dim=1).tolist()
    tokens = Sampler(CPU).sample(logits, reqs, mask_type(bitmask, [0, 2, 4])).tokens.tolist()
    assert tokens[0::2] == [7, 7, 7]
    assert tokens[1::2] == free[1::2]


class ScriptedMatcher:
    """Fills an all-allowed row; ``waits`` gives, per call, an Event to wait on first (None: no wait)."""

    def __init__(self, waits: list[threading.Event | None], log: list[str], name: str):
        self.waits, self.log, self.name = waits, log, name

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        gate = self.waits.pop(0) if self.waits else None
        if gate is not None:
            gate.wait(10)
        bitmask[row] = -1
        self.log.append(f"filled {self.name}")


def test_a_mask_past_its_budget_makes_its_row_late_and_the_others_go_on(
    registry: PluginRegistry, tokenizer: object
) -> None:
    backend = _backend(registry, tokenizer)
    backend.limits = GrammarLimits(mask_seconds=0.05)
    log: list[str] = []
    slow_then_stuck = threading.Event()  # never set before fill returns: a fill waiting for it is stuck
    took_long = threading.Event()
    threading.Timer(0.2, took_long.set).start()
    quick = ScriptedMatcher([], log, "quick")
    turns = ScriptedMatcher([None, took_long, slow_then_stuck], log, "turns")
    # Step 1: both quick. Step 2: "turns" takes 0.2 s in this thread: done, but past the budget, so late.
    assert backend.fill([(0, quick), (1, turns)], 2).late == []
    mask = backend.fill([(0, quick), (1, turns)], 2)
    assert mask.late == [1] and mask.rows == [0]
    # A matcher slower than a quarter of the budget last time is filled on a thread, and left there once past it.
    backend._last_fill[id(turns)] = 0.04
    mask = backend.fill([(0, quick), (1, turns)], 2)
    assert log.count("filled turns") == 2  # returned while its third fill still waited
    slow_then_stuck.set()
    assert mask.late == [1] and mask.rows == [0]
    assert backend._host is None  # its row may still be written: the next step takes a fresh buffer
    assert backend.fill([(0, quick)], 1).late == []
    backend.close()
