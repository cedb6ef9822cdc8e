"""Choosing the quantization method (``--quantization``) from the setting and the checkpoint's
``quantization_config``, without importing torch: the server's preflight and the engine ask the same question."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .registry import PluginRegistry
from .specs import QuantizationSpec, UnknownComponentError

GUIDE = "docs/user-guide.md#quantization"


@dataclass(frozen=True)
class QuantChoice:
    """The method to build and the ``quantization_config`` its factory reads (None: quantize at load)."""

    spec: QuantizationSpec
    config: dict[str, Any] | None


def read_model_config(path: str | Path) -> dict[str, Any] | None:
    """A model directory's ``config.json`` or a config file, as a dict (None if there is none or it is not JSON:
    the engine's config loader reports an unreadable config)."""
    path = Path(path)
    path = path / "config.json" if path.is_dir() else path
    if path.suffix != ".json" or not path.is_file():  # a .gguf file holds its config itself
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def quantization_config_of(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``quantization_config`` of a model config read by :func:`read_model_config` (None without one)."""
    found = config.get("quantization_config") if config is not None else None
    return found if isinstance(found, dict) and found else None


def read_quantization_config(path: str | Path) -> dict[str, Any] | None:
    """``quantization_config`` of a model directory's ``config.json`` or of a config file (None without one)."""
    return quantization_config_of(read_model_config(path))


def _installed(registry: PluginRegistry) -> str:
    rows = []
    for spec in registry.specs("quantization"):
        plugin = registry.provider("quantization", spec.name)
        methods = getattr(spec, "quant_methods", ())
        reads = f", reads quant_method {', '.join(methods)}" if methods else ""
        rows.append(f"{spec.name} ({plugin.distribution or plugin.name}{reads})")
    return "; ".join(rows) or "none"


def choose_quantization(
    registry: PluginRegistry, name: str, quant_config: dict[str, Any] | None, device: str
) -> QuantChoice:
    """The method for setting ``name`` (``auto``: the one that reads the checkpoint's ``quant_method``, else
    ``none``) and checkpoint config ``quant_config``; :class:`UnknownComponentError` saying what is installed
    when no installed method reads the checkpoint or the named one cannot load it."""
    method = str(quant_config.get("quant_method", "")) if quant_config is not None else None
    if quant_config is not None and not method:
        raise UnknownComponentError(
            "the checkpoint's quantization_config has no quant_method, so minisgl cannot tell how its weights are "
            f"stored; installed quantization methods: {_installed(registry)}. See {GUIDE}."
        )
    if name == "auto":
        if method is None:
            return QuantChoice(registry.pick("quantization", "none", device), None)  # type: ignore[arg-type]
        readers = [s for s in registry.specs("quantization") if method in getattr(s, "quant_methods", ())]
        if not readers:
            raise UnknownComponentError(
                f"the checkpoint is quantized with quant_method '{method}' (config.json, quantization_config), "
                f"which no installed plugin reads; installed quantization methods: {_installed(registry)}. "
                "Install a plugin that reads it (minisgl-plugin-fp8 reads 'fp8' and 'compressed-tensors'), "
                f"`minisgl plugins` lists what is installed; see {GUIDE}."
            )
        name = readers[0].name
    spec = registry.pick("quantization", name, device)
    assert isinstance(spec, QuantizationSpec)
    if method is not None and method not in spec.quant_methods:
        names = [s.name for s in registry.specs("quantization") if method in getattr(s, "quant_methods", ())]
        instead = f"use --quantization {names[0]} or auto" if names else "no installed method reads it"
        raise UnknownComponentError(
            f"--quantization {name}: the checkpoint is quantized with quant_method '{method}', which the "
            f"{spec.label} does not read ({instead}); installed quantization methods: {_installed(registry)}"
        )
    return QuantChoice(spec, quant_config)
