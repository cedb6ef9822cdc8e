"""Hook specifications: the plugin author's reference.

Every hook takes no arguments and returns an iterable of spec dataclasses
(see :mod:`minisgl.plugins.specs`). Hooks are called once, at start-up, and
their results are stored in plain registries; nothing here runs per step.

A plugin is a module registered under the ``minisgl`` entry-point group that
defines any subset of these functions, each decorated with ``@hookimpl``::

    from minisgl.plugins import hookimpl, AttentionBackendSpec

    @hookimpl
    def minisgl_attention_backends():
        return [AttentionBackendSpec(name="mykernel", factory="my_pkg.backend:MyBackend")]

The entry module imports only ``minisgl.plugins``: kernel libraries are imported
by the factory (the lazy ``"module:attribute"`` string), when a component is built.
docs/plugins.md is the full guide.
"""

from __future__ import annotations

from collections.abc import Iterable

import pluggy

from .specs import (
    AttentionBackendSpec,
    Kind,
    KVPoolSpec,
    ModelSpec,
    MoEBackendSpec,
    PrefixCacheSpec,
)

PROJECT = "minisgl"
hookspec = pluggy.HookspecMarker(PROJECT)
#: Decorate each hook function of a plugin's entry module with this.
hookimpl = pluggy.HookimplMarker(PROJECT)

#: The hook that declares each component kind.
HOOKS: dict[Kind, str] = {
    "model": "minisgl_models",
    "attention": "minisgl_attention_backends",
    "kv_pool": "minisgl_kv_cache_pools",
    "prefix_cache": "minisgl_prefix_caches",
    "moe": "minisgl_moe_backends",
}


@hookspec
def minisgl_models() -> Iterable[ModelSpec]:
    """Model architectures, keyed by the Hugging Face ``architectures`` name.

    The factory is called with a :class:`minisgl.models.ModelContext` and returns
    a :class:`minisgl.models.CausalLM`.
    """
    raise NotImplementedError


@hookspec
def minisgl_attention_backends() -> Iterable[AttentionBackendSpec]:
    """Attention backends (``--attn NAME``).

    The factory is called with a :class:`minisgl.attention.AttentionContext` and
    returns a :class:`minisgl.attention.BaseAttnBackend`.
    """
    raise NotImplementedError


@hookspec
def minisgl_kv_cache_pools() -> Iterable[KVPoolSpec]:
    """KV cache pools (``--kv-pool NAME``).

    The factory is called with a :class:`minisgl.kvcache.KVLayout` and returns a
    :class:`minisgl.kvcache.BaseKVPool`.
    """
    raise NotImplementedError


@hookspec
def minisgl_prefix_caches() -> Iterable[PrefixCacheSpec]:
    """Prefix caches (``--cache NAME``).

    The factory is called as ``factory(page_size=..., device=...)`` and returns a
    :class:`minisgl.kvcache.BasePrefixCache`.
    """
    raise NotImplementedError


@hookspec
def minisgl_moe_backends() -> Iterable[MoEBackendSpec]:
    """Mixture-of-experts backends (``--moe-backend NAME``).

    The factory is called with no arguments and returns a
    :class:`minisgl.moe.BaseMoEBackend`.
    """
    raise NotImplementedError
