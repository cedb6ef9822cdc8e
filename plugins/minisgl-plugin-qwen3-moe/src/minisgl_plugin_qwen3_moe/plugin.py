"""Entry module: declares the architecture and the MoE backend; Triton is imported only when the backend is built."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

from minisgl.plugins import ModelSpec, MoEBackendSpec, hookimpl


def fused_supported(device: str) -> bool:
    """The fused backend runs Triton kernels: CUDA devices with Triton installed."""
    return device.startswith("cuda") and importlib.util.find_spec("triton") is not None


@hookimpl
def minisgl_models() -> Iterable[ModelSpec]:
    return [ModelSpec(name="Qwen3MoeForCausalLM", factory="minisgl_plugin_qwen3_moe.qwen3_moe:Qwen3MoeForCausalLM")]


@hookimpl  # a plain hook ranks above the built-in 'torch' (trylast) under --moe-backend auto
def minisgl_moe_backends() -> Iterable[MoEBackendSpec]:
    return [
        MoEBackendSpec(
            name="fused",
            auto=True,
            factory="minisgl_plugin_qwen3_moe.fused_moe:FusedMoEBackend",
            is_supported=fused_supported,
            description="Triton fused MoE: token-to-expert alignment, grouped GEMMs with SiLU-and-multiply (CUDA)",
        )
    ]
