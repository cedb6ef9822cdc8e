# mypy: disable-error-code="empty-body"
"""The hooks a plugin implements: each takes no arguments and returns a list of specs of its kind.

Decorate them with ``@hookimpl`` in the plugin's entry module; docs/plugins.md is the guide.
pluggy's call order is the order ``auto`` prefers: ``@hookimpl(tryfirst=True)`` ranks a plugin's
components above those of plain plugins, ``@hookimpl(trylast=True)`` below them (the built-ins are
``trylast``); within one plugin, the order of its list.
"""

from __future__ import annotations

import pluggy

from .specs import AttentionBackendSpec, KernelSetSpec, Kind, KVPoolSpec, ModelSpec, MoEBackendSpec, PrefixCacheSpec

hookspec = pluggy.HookspecMarker("minisgl")
hookimpl = pluggy.HookimplMarker("minisgl")

#: The hook that declares each component kind.
HOOKS: dict[Kind, str] = {
    "model": "minisgl_models",
    "attention": "minisgl_attention_backends",
    "kv_pool": "minisgl_kv_cache_pools",
    "prefix_cache": "minisgl_prefix_caches",
    "moe": "minisgl_moe_backends",
    "kernels": "minisgl_kernel_sets",
}


@hookspec
def minisgl_models() -> list[ModelSpec]:
    """Model architectures, named as in a checkpoint's ``config.json`` ``architectures``."""


@hookspec
def minisgl_attention_backends() -> list[AttentionBackendSpec]:
    """Attention backends (``--attn NAME``)."""


@hookspec
def minisgl_kv_cache_pools() -> list[KVPoolSpec]:
    """KV cache pools (``--kv-pool NAME``)."""


@hookspec
def minisgl_prefix_caches() -> list[PrefixCacheSpec]:
    """Prefix caches (``--cache NAME``)."""


@hookspec
def minisgl_moe_backends() -> list[MoEBackendSpec]:
    """Mixture-of-experts backends (``--moe-backend NAME``)."""


@hookspec
def minisgl_kernel_sets() -> list[KernelSetSpec]:
    """Kernel sets for the layers (``--kernels NAME``)."""
