"""Entry module: declares the ``triton`` kernel set; Triton is imported only when it is built."""

from __future__ import annotations

import importlib.util

from minisgl.plugins import KernelSetSpec, Unsupported, hookimpl


def supported(device_type: str) -> bool:
    """CUDA, with Triton importable."""
    if device_type != "cuda":
        raise Unsupported("runs on CUDA only")
    if importlib.util.find_spec("triton") is None:
        raise Unsupported("Triton is not installed (pip install triton)")
    return True


@hookimpl  # a plain hook ranks above the core's torch kernel set (trylast)
def minisgl_kernel_sets() -> list[KernelSetSpec]:
    return [
        KernelSetSpec(
            name="triton",
            auto=True,
            factory="minisgl_plugin_triton.kernels:triton_kernels",
            is_supported="minisgl_plugin_triton.plugin:supported",
            description="fused RMSNorm (+ residual), q/k-norm + rope, SiLU x up, KV store, sampling (CUDA)",
        )
    ]
