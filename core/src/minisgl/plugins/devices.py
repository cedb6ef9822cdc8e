"""Which CUDA GPUs this process may use, and their generation, without creating a CUDA context.

Support checks (``is_supported``) run in ``minisgl plugins`` and in the server's
preflight, before any worker loads torch: they ask NVML, the driver's management
library, through ctypes. Where torch has already set CUDA up in this process its
answer is exact and is used instead; without NVML torch answers too.
"""

from __future__ import annotations

import ctypes
import os
import sys

Capability = tuple[int, int]


def only_visible(caps: list[Capability], visible: str | None) -> list[Capability]:
    """The entries of ``caps`` (NVML order) that ``CUDA_VISIBLE_DEVICES`` leaves visible.

    Index lists are applied up to the first invalid index, as CUDA does. UUIDs and MIG
    names are not resolved: every device is kept then (checks require support of all).
    """
    if visible is None:
        return caps
    items = [s.strip() for s in visible.split(",") if s.strip()]
    if not all(s.lstrip("-").isdigit() for s in items):
        return caps
    picked = []
    for s in items:
        i = int(s)
        if not 0 <= i < len(caps):
            break
        picked.append(caps[i])
    return picked


def nvml_capabilities() -> list[Capability] | None:
    """Compute capability of every GPU per NVML, in NVML order; ``None`` when NVML cannot answer."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        caps = []
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
    caps = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        caps.append((int(major), int(minor)))
    return caps
