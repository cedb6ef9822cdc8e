"""The device ``--device auto`` will get, told before any worker (or torch) starts."""

from __future__ import annotations

from pathlib import Path


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
