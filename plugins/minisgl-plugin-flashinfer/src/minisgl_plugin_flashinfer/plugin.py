"""Entry module: declares the backend; ``flashinfer`` is imported only by the factory."""

from __future__ import annotations

from collections.abc import Iterable

from minisgl.plugins import AttentionBackendSpec, hookimpl

#: The quantized KV cache dtypes the backend reads besides the model dtype (its spec's ``kv_cache_dtypes``).
KV_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2")


def is_supported(device: str) -> bool:
    """CUDA only, and only where the ``flashinfer`` package can be found (without importing it)."""
    if not device.startswith("cuda"):
        return False
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None


@hookimpl(tryfirst=True)  # --attn auto prefers it to every other plugin's backend where it runs
def minisgl_attention_backends() -> Iterable[AttentionBackendSpec]:
    return [
        AttentionBackendSpec(
            name="flashinfer",
            auto=True,
            factory="minisgl_plugin_flashinfer.backend:FlashInferAttnBackend",
            aliases=("fi",),
            is_supported=is_supported,
            description="FlashInfer paged prefill and decode (CUDA graphs for decode; FP8 KV cache)",
            kv_cache_dtypes=KV_CACHE_DTYPES,
        )
    ]
