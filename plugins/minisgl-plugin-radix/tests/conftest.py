"""The plugin's tests run on a tiny random Llama-shaped model assembled from core blocks.

The model comes from a test-only plugin defined here, so these tests need no
architecture plugin installed: just core and this package.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from minisgl import LLM
from minisgl.plugins import PluginRegistry
from minisgl.testing.models import save_tiny_model
from minisgl.testing.registry import registry_with_test_model


def _registry(*names: str) -> PluginRegistry:
    return registry_with_test_model(*names, environ={})


@pytest.fixture(scope="session")
def registry() -> PluginRegistry:
    """Core built-ins, this plugin (through its installed entry point) and the test model."""
    return _registry("builtin", "radix")


@pytest.fixture(scope="session")
def core_only_registry() -> PluginRegistry:
    return _registry("builtin")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("LlamaForCausalLM", path)
    return path


@pytest.fixture
def make_llm(tiny_dir: Path, registry: PluginRegistry) -> Iterator:
    """Build LLMs on the tiny model (float32); after the test, every KV page must be accounted for."""
    made: list[LLM] = []

    def build(**kwargs) -> LLM:  # type: ignore[no-untyped-def]
        kwargs.setdefault("dtype", "float32")
        llm = LLM(str(tiny_dir), registry=registry, **kwargs)
        made.append(llm)
        return llm

    yield build
    for llm in made:
        llm.check_accounting()
        assert llm.kv_pages_in_use == 0
        assert llm.scheduler.kv.cache.protected_size == 0, "a finished run left a prefix locked"
        llm.close()
