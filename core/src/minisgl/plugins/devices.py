"""The compute capability of the CUDA GPUs this process may use, without creating a CUDA context: support
checks run before any worker loads torch, so they ask NVML through ctypes (torch where it has set CUDA up)."""

from __future__ import annotations

import ctypes
import itertools
import os
import sys

Capability = tuple[int, int]


def only_visible(caps: list[Capability], visible: str | None) -> list[Capability]:
    """The entries of ``caps`` (NVML order) that ``CUDA_VISIBLE_DEVICES`` leaves, up to the first invalid
    index as CUDA does; with UUIDs or MIG names, all of them."""
    items = [s.strip() for s in (visible or "").split(",") if s.strip()]
    if visible is None or not all(s.lstrip("-").isdigit() for s in items):
        return caps
    return [caps[i] for i in itertools.takewhile(lambda i: 0 <= i < len(caps), map(int, items))]


def nvml_capabilities() -> list[Capability] | None:
    """Compute capability of every GPU per NVML, in NVML order; ``None`` when NVML cannot answer."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count, caps = ctypes.c_uint(), []
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        for i in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(handle)) != 0:
                return None
            if nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0:
                return None
            caps.append((major.value, minor.value))
        return caps
    finally:
        nvml.nvmlShutdown()


def cuda_capabilities() -> list[Capability]:
    """Compute capability of each GPU this process may use (``[]``: none)."""
    loaded = sys.modules.get("torch")
    if loaded is None or not loaded.cuda.is_initialized():
        caps = nvml_capabilities()
        if caps is not None:
            return only_visible(caps, os.environ.get("CUDA_VISIBLE_DEVICES"))
    import torch

    if not torch.cuda.is_available():
        return []
    return [tuple(map(int, torch.cuda.get_device_capability(i))) for i in range(torch.cuda.device_count())]  # type: ignore[misc]
