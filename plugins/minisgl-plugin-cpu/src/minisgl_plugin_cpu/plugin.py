"""Entry module: declares the ``cpu`` attention backend and the ``native`` kernel set; nothing is built
(or compiled) until an engine asks for them."""

from __future__ import annotations

from minisgl.plugins import AttentionBackendSpec, KernelSetSpec, hookimpl

SUPPORTED = "minisgl_plugin_cpu.attention:supported"  # CPU, with the C kernels built


@hookimpl  # a plain hook ranks above the core's torch components (trylast)
def minisgl_attention_backends() -> list[AttentionBackendSpec]:
    return [
        AttentionBackendSpec(
            name="cpu",
            auto=True,
            factory="minisgl_plugin_cpu.attention:CPUAttnBackend",
            is_supported=SUPPORTED,
            description="native C kernels over the paged KV cache (CPU, float32)",
        )
    ]


@hookimpl
def minisgl_kernel_sets() -> list[KernelSetSpec]:
    return [
        KernelSetSpec(
            name="native",
            auto=True,
            factory="minisgl_plugin_cpu.kernels:native_kernels",
            is_supported=SUPPORTED,
            description="C kernels: few-row GEMM, RMSNorm, rope, SiLU x up, KV store, argmax (CPU, float32)",
        )
    ]
