"""Entry module: declares the two backends; FlashInfer is imported only by their factories.

``trtllm``
    TensorRT-LLM-gen kernels for prefill and decode (compute capability 10.0/10.3).
``trtllm-xqa`` (alias ``xqa``)
    TensorRT-LLM's XQA kernel for decode (Hopper and Blackwell), over a 16-bit or an
    FP8 KV cache; prefill batches go to the core's ``torch`` reference, so pair it
    with a prefill backend: ``--attn flashinfer,trtllm-xqa``. Under ``--attn auto``
    it decodes an FP8 cache (``decode_kv_cache_dtypes``) and the best-ranked backend
    (FlashInfer) prefills.

Their ``is_supported`` checks (``minisgl_plugin_trtllm.support``) say why a GPU
cannot run them, and use no torch and no CUDA context.
"""

from __future__ import annotations

from collections.abc import Iterable

from minisgl.plugins import AttentionBackendSpec, hookimpl


# A plain hook: 'auto' ranks these below flashinfer (tryfirst: trtllm-gen has not yet run on Blackwell
# hardware) and above the built-ins (trylast); trtllm before trtllm-xqa, in list order.
@hookimpl
def minisgl_attention_backends() -> Iterable[AttentionBackendSpec]:
    return [
        AttentionBackendSpec(
            name="trtllm",
            auto=True,
            factory="minisgl_plugin_trtllm.backend:build_trtllm_gen",
            is_supported="minisgl_plugin_trtllm.support:trtllm_gen_supported",
            description="TensorRT-LLM-gen paged prefill and decode via FlashInfer (compute capability 10.0/10.3)",
        ),
        AttentionBackendSpec(
            name="trtllm-xqa",
            auto=True,
            factory="minisgl_plugin_trtllm.backend:build_xqa",
            aliases=("xqa",),
            is_supported="minisgl_plugin_trtllm.support:xqa_supported",
            kv_cache_dtypes=("fp8_e4m3",),
            # It reads an FP8 cache at twice FlashInfer's rate (H200: 172.8 against 335.9 us per decode call
            # at batch 256, Qwen3-8B's heads), so '--attn auto' decodes an FP8 cache with it; over a bf16
            # cache FlashInfer's tensor-core decode is the faster (334.1 against 374.6).
            decode_kv_cache_dtypes=("fp8_e4m3",),
            description="TensorRT-LLM XQA paged decode via FlashInfer (Hopper/Blackwell; bf16/fp16 or FP8 KV; "
            "the 'auto' decode of an FP8 cache); prefill via torch unless paired, e.g. --attn flashinfer,trtllm-xqa",
        ),
    ]
