"""The plugin's tests need only the core and this package: the model is the core's test model."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl.plugins import PluginRegistry
from minisgl.testing.models import save_tiny_model
from minisgl.testing.registry import registry_with_test_model


@pytest.fixture(scope="session")
def registry() -> PluginRegistry:
    """Core built-ins, this plugin (through its installed entry point) and the test model."""
    return registry_with_test_model("builtin", "cpu", environ={})


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("LlamaForCausalLM", path)
    return path
