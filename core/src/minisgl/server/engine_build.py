"""The engine configuration a worker builds from the plain settings it receives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import EngineConfig


def engine_config(fields: dict[str, Any]) -> EngineConfig:
    """An :class:`EngineConfig` from plain values; ``device="auto"`` becomes cuda when torch sees a GPU."""
    from ..config import EngineConfig

    values = dict(fields)
    if values.get("device", "auto") == "auto":
        import torch

        values["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if values.get("plugins") is not None:
        values["plugins"] = tuple(values["plugins"])
    return EngineConfig(**values)
