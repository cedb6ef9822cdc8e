"""Entry module: declares the FlashAttention backends; no kernel library is imported here.

``fa``
    The best FlashAttention generation installed for this GPU (3, then 4, then 2
    on Hopper; 4, then 2 on Blackwell; 2 on Ampere), chosen when the engine is built.
``fa2``, ``fa3``, ``fa4``
    One generation each, for comparisons and pinned deployments.

``is_supported`` (``minisgl_plugin_fa.support``) says why a machine cannot run them.
"""

from __future__ import annotations

from collections.abc import Iterable

from minisgl.plugins import AttentionBackendSpec, hookimpl


# A plain hook: --attn auto ranks these below flashinfer (tryfirst) and above the built-ins (trylast).
@hookimpl
def minisgl_attention_backends() -> Iterable[AttentionBackendSpec]:
    specs = [  # best first: 'auto' prefers the generation-choosing 'fa'
        AttentionBackendSpec(
            name="fa",
            auto=True,
            factory="minisgl_plugin_fa.backend:FlashAttnBackend",
            aliases=("flash-attn",),
            is_supported="minisgl_plugin_fa.support:is_supported",
            description="FlashAttention paged prefill and decode (CUDA graphs for decode), best generation installed",
        )
    ]
    for gen in (2, 3, 4):
        specs.append(
            AttentionBackendSpec(
                name=f"fa{gen}",
                auto=True,
                factory=f"minisgl_plugin_fa.backend:fa{gen}_backend",
                is_supported=f"minisgl_plugin_fa.support:fa{gen}_supported",
                description=f"FlashAttention {gen} paged prefill and decode (CUDA graphs for decode)",
            )
        )
    return specs
