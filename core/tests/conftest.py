"""Core tests run with the built-in plugin only, plus a test model.

The model (minisgl.testing.registry.CoreBlocksLM) is assembled from core's
public blocks exactly like an architecture plugin would be, so the core is
tested without any plugin package installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from minisgl import LLM
from minisgl.plugins import PluginRegistry
from minisgl.testing.models import save_tiny_model, save_word_tokenizer
from minisgl.testing.registry import registry_with_test_model


@pytest.fixture(scope="session")
def registry() -> PluginRegistry:
    """Built-ins plus the test model, whatever else is installed."""
    return registry_with_test_model("builtin")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("LlamaForCausalLM", path)
    save_word_tokenizer(path, 512)
    return path


@pytest.fixture(scope="session")
def hf_model(tiny_dir: Path):  # noqa: ANN201 - a transformers model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


@pytest.fixture
def make_llm(tiny_dir: Path, registry: PluginRegistry) -> Iterator:
    """Build LLMs on the tiny model; after the test, every KV page must be back."""
    made: list[LLM] = []

    def build(**kwargs) -> LLM:  # type: ignore[no-untyped-def]
        kwargs.setdefault("page_size", 4)
        llm = LLM(str(tiny_dir), registry=registry, **kwargs)
        made.append(llm)
        return llm

    yield build
    for llm in made:
        llm.check_accounting()
        assert llm.kv_pages_in_use == 0
        llm.close()
