"""The engine configuration a worker builds from the plain settings it receives."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import EngineConfig


def likely_device() -> str | None:
    """The device ``--device auto`` will get ("cuda" or "cpu"), told without importing torch; None if unsure.

    torch picks CUDA when it is a CUDA build (written in ``torch/version.py``) and a GPU is
    visible (asked of the driver through NVML, see :mod:`minisgl.plugins.devices`).
    """
    import importlib.util
    import os
    import re

    from ..plugins import devices

    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "cpu"
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        version = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None
    match = re.search(r"^cuda\b.*=\s*(.+)$", version, re.MULTILINE)
    if match is None:
        return None
    if match.group(1).strip() == "None":
        return "cpu"
    caps = devices.nvml_capabilities()
    if caps is None:
        return None  # no driver library to ask: leave the device to the worker
    return "cuda" if devices.only_visible(caps, os.environ.get("CUDA_VISIBLE_DEVICES")) else "cpu"


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
