"""The core's own components, the ``builtin`` entry point: ``trylast``, so under ``auto`` every other
plugin's components rank above them. Factories are lazy strings: loading this module imports no torch."""

from __future__ import annotations

from .hookspecs import hookimpl
from .specs import AttentionBackendSpec, KernelSetSpec, KVPoolSpec, MoEBackendSpec, PrefixCacheSpec, QuantizationSpec


@hookimpl(trylast=True)
def minisgl_attention_backends() -> list[AttentionBackendSpec]:
    desc = "reference attention in plain PyTorch over the paged KV cache (CPU and CUDA)"
    return [
        AttentionBackendSpec(
            name="torch",
            auto=True,
            factory="minisgl.attention.torch_backend:TorchAttnBackend",
            description=desc,
            kv_cache_dtypes=("fp8_e4m3", "fp8_e5m2"),
        )
    ]


@hookimpl(trylast=True)
def minisgl_kv_cache_pools() -> list[KVPoolSpec]:
    desc = "paged K/V buffers, one per layer, [pages, page_size, kv_heads, head_dim]"
    return [KVPoolSpec(name="mha", auto=True, factory="minisgl.kvcache.pool:MHAKVPool", description=desc)]


@hookimpl(trylast=True)
def minisgl_prefix_caches() -> list[PrefixCacheSpec]:
    desc = "no prefix reuse: every request computes its whole prompt"
    return [
        PrefixCacheSpec(name="naive", auto=True, factory="minisgl.kvcache.naive:NaivePrefixCache", description=desc)
    ]


@hookimpl(trylast=True)
def minisgl_moe_backends() -> list[MoEBackendSpec]:
    desc = "reference mixture-of-experts: sorted tokens, one matmul pair per expert"
    return [
        MoEBackendSpec(name="torch", auto=True, factory="minisgl.moe.torch_backend:TorchMoEBackend", description=desc)
    ]


@hookimpl(trylast=True)
def minisgl_kernel_sets() -> list[KernelSetSpec]:
    desc = "the layers' ops in plain PyTorch (the reference; any device and dtype)"
    return [KernelSetSpec(name="torch", auto=True, factory="minisgl.kernel:torch_kernels", description=desc)]


@hookimpl(trylast=True)
def minisgl_quantization_methods() -> list[QuantizationSpec]:
    desc = "weights in the model's dtype (checkpoints without a quantization_config)"
    return [QuantizationSpec(name="none", auto=True, factory="minisgl.layers.quant:unquantized", description=desc)]
