"""The core's own kernels: Triton on CUDA, C on CPU, used where profiling showed PyTorch glue costing time.

The CPU kernels live in :mod:`minisgl.kernel.cpu` (:func:`cpu_kernels` returns them
for float32 layers on CPU, or ``None``); the rest of this page is about Triton.

:func:`enabled` says whether layers built for ``device`` use them: CUDA, Triton
importable, and ``MINISGL_DISABLE_TRITON`` unset (for ablations). It is read
when a layer is built, never per call.

Triton compiles a variant of a kernel for each new "specialisation" of its
arguments (an integer equal to 1 or divisible by 16, a pointer aligned to 16
bytes). Arguments that change from call to call (row counts, per-step seeds,
slices of a packed input buffer) are marked ``do_not_specialize`` so that a
running server never stops to compile a kernel for a shape it has not met.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch


def enabled(device: torch.device | str | None) -> bool:
    if device is None or torch.device(device).type != "cuda":
        return False
    if os.environ.get("MINISGL_DISABLE_TRITON", "") not in ("", "0", "false", "False"):
        return False
    return importlib.util.find_spec("triton") is not None


def cpu_kernels(device: torch.device | str | None, dtype: torch.dtype | None) -> Any:
    """The native CPU kernels for a float32 layer on CPU (a :class:`~minisgl.kernel.cpu.CpuKernels`),
    else ``None``: other devices and dtypes, ``MINISGL_DISABLE_CPU_KERNELS``, or no C compiler."""
    if torch.device(device or "cpu").type != "cpu" or (dtype or torch.get_default_dtype()) != torch.float32:
        return None
    from .cpu import load_cpu_kernels

    return load_cpu_kernels()


def rmsnorm_kernel() -> Callable[..., Any]:
    """The fused RMSNorm (imports Triton)."""
    from .norm_rope import rmsnorm

    return rmsnorm


def qk_norm_rope_kernel() -> Callable[..., Any]:
    """Rotary embedding of q and k (with Qwen3's per-head q/k RMSNorm first) in one launch (imports Triton)."""
    from .norm_rope import qk_norm_rope

    return qk_norm_rope


def gumbel_sampler() -> Callable[..., Any]:
    """One-pass temperature sampling (imports Triton)."""
    from .sampling import gumbel_sample

    return gumbel_sample


def silu_mul_kernel() -> Callable[..., Any]:
    """Fused SiLU-and-multiply of the gated MLP (imports Triton)."""
    from .norm_rope import silu_and_mul

    return silu_and_mul


def store_kv_kernel() -> Callable[..., Any]:
    """K and V rows into the paged pool in one launch (imports Triton)."""
    from .store import store_kv

    return store_kv
