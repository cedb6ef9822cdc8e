"""The engine configuration a worker builds from the plain settings it receives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import EngineConfig


def device_defaults(device: str) -> dict[str, int]:
    """Batch limits for a server on ``device`` where none are set.

    A GPU step costs about the same for 1 or 256 decoding requests and for 512 or 8192
    prompt tokens, so a GPU server admits a whole burst at once; a CPU step costs in
    proportion to its tokens, so a CPU server keeps steps short for its streams' sake.
    """
    if device.startswith("cuda"):
        return {"max_running_requests": 256, "chunked_prefill_size": 8192}
    return {"max_running_requests": 64, "chunked_prefill_size": 512}


def engine_config(fields: dict[str, Any]) -> EngineConfig:
    """An :class:`EngineConfig` from plain values; ``device="auto"`` becomes cuda when torch sees a GPU."""
    from ..config import EngineConfig

    values = dict(fields)
    if values.get("device", "auto") == "auto":
        import torch

        values["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    for name, value in device_defaults(values["device"]).items():
        if values.get(name) is None:
            values[name] = value
    if values.get("plugins") is not None:
        values["plugins"] = tuple(values["plugins"])
    return EngineConfig(**values)
