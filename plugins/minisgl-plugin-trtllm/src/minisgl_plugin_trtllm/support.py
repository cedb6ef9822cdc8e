"""Which GPUs each TensorRT-LLM kernel family runs on, checked without importing torch.

FlashInfer 0.5.3 exposes two families of TensorRT-LLM attention kernels:

* **trtllm-gen** (``trtllm_batch_context_with_kv_cache``, and
  ``trtllm_batch_decode_with_kv_cache(backend="trtllm-gen")``): precompiled cubins
  that FlashInfer's runner accepts on compute capability 10.0 and 10.3 only
  (``include/flashinfer/trtllm/fmha/fmhaRunner.cuh``). The cubins are not in the
  ``flashinfer-python`` wheel: they come from the ``flashinfer-cubin`` package, a
  folder named by ``FLASHINFER_CUBIN_DIR``, or a download from NVIDIA's artifactory
  at first use (``flashinfer/jit/cubin_loader.py``).
* **XQA** (``trtllm_batch_decode_with_kv_cache(backend="xqa")``): decode only,
  compiled on first use from CUDA sources shipped in the wheel
  (``flashinfer/jit/xqa.py``); FlashInfer runs it on compute capability 9.x, 10.x
  and 12.x (``flashinfer/xqa.py``), so on Hopper too.

The checks here back the specs' ``is_supported`` (they raise
:class:`~minisgl.plugins.specs.Unsupported` with the reason) and the factories'
build-time checks (which raise ``ValueError`` with the same words). The device
query goes through NVML, so ``minisgl plugins --device cuda`` and ``minisgl
serve`` learn the GPU generation without creating a CUDA context.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence

from minisgl.plugins import Unsupported

Capability = tuple[int, int]

TRTLLM_GEN_CAPABILITIES: tuple[Capability, ...] = ((10, 0), (10, 3))
XQA_MAJORS: tuple[int, ...] = (9, 10, 12)
INSTALL_HINT = "pip install 'minisgl-plugin-trtllm[cuda]'"


def _only_visible(caps: list[Capability], visible: str | None) -> list[Capability]:
    """The entries of ``caps`` (NVML order) that ``CUDA_VISIBLE_DEVICES`` leaves visible.

    Integer lists are applied up to the first invalid index, as CUDA does; UUIDs and
    MIG names are not resolved (every device is then kept: a conservative answer,
    since support is required of all of them).
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


def _nvml_capabilities() -> list[Capability] | None:
    """Compute capability of every GPU per NVML (the driver's library); ``None`` if NVML is unusable."""
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
            handle = ctypes.c_void_p()
            major, minor = ctypes.c_int(), ctypes.c_int()
            if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(handle)) != 0:
                return None
            if nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0:
                return None
            caps.append((major.value, minor.value))
        return caps
    finally:
        nvml.nvmlShutdown()


def visible_compute_capabilities() -> list[Capability]:
    """Compute capability of every GPU this process may use (``[]``: none).

    Uses torch when this process has already initialised CUDA (exact), otherwise
    NVML (no CUDA context; ``CUDA_VISIBLE_DEVICES`` applied by index), and torch
    as the last resort.
    """
    loaded = sys.modules.get("torch")
    if loaded is None or not loaded.cuda.is_initialized():
        caps = _nvml_capabilities()
        if caps is not None:
            return _only_visible(caps, os.environ.get("CUDA_VISIBLE_DEVICES"))
    import torch

    return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


def flashinfer_installed() -> bool:
    """Whether FlashInfer can be imported (without importing it)."""
    return importlib.util.find_spec("flashinfer") is not None


def _shown(caps: Sequence[Capability]) -> str:
    found = sorted(set(caps))
    return ", ".join(f"{a}.{b}" for a, b in found)


def trtllm_gen_problem(caps: Sequence[Capability]) -> str | None:
    """Why the trtllm-gen kernels cannot run on GPUs of these capabilities (``None``: they can)."""
    if not caps:
        return "no CUDA GPU is visible"
    if all(c in TRTLLM_GEN_CAPABILITIES for c in caps):
        return None
    hint = "use --attn flashinfer"
    if xqa_problem(caps) is None:
        hint += ", or TensorRT-LLM's XQA decode kernel with --attn flashinfer,trtllm-xqa"
    return (
        "TensorRT-LLM-gen attention kernels (trtllm_batch_context_with_kv_cache) run only on compute capability "
        f"10.0 or 10.3 (B200/GB200, B300/GB300); this machine's GPU is {_shown(caps)}; {hint}"
    )


def xqa_problem(caps: Sequence[Capability]) -> str | None:
    """Why the XQA decode kernel cannot run on GPUs of these capabilities (``None``: it can)."""
    if not caps:
        return "no CUDA GPU is visible"
    if all(major in XQA_MAJORS for major, _ in caps):
        return None
    return (
        "TensorRT-LLM's XQA decode kernel runs on compute capability 9.x, 10.x or 12.x (Hopper, Blackwell); "
        f"this machine's GPU is {_shown(caps)}; use --attn flashinfer"
    )


def _check(device: str, problem_of: Callable[[Sequence[Capability]], str | None]) -> bool:
    if device != "cuda":
        raise Unsupported("TensorRT-LLM attention kernels need a CUDA GPU; use --attn torch")
    if not flashinfer_installed():
        raise Unsupported(f"FlashInfer, which provides the TensorRT-LLM kernels, is not installed: {INSTALL_HINT}")
    problem = problem_of(visible_compute_capabilities())
    if problem:
        raise Unsupported(problem)
    return True


def trtllm_gen_supported(device: str) -> bool:
    """``is_supported`` of the ``trtllm`` backend: CUDA, FlashInfer installed, every GPU 10.0 or 10.3."""
    return _check(device, trtllm_gen_problem)


def xqa_supported(device: str) -> bool:
    """``is_supported`` of the ``trtllm-xqa`` backend: CUDA, FlashInfer installed, every GPU 9.x/10.x/12.x."""
    return _check(device, xqa_problem)
