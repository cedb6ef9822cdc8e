# mypy: disable-error-code="empty-body"
"""The hooks a plugin implements (docs/plugins.md): each takes no arguments and returns a list of specs
of its kind. pluggy's call order is the order ``auto`` prefers: ``@hookimpl(tryfirst=True)`` ranks a
plugin's components above those of plain plugins, ``trylast`` (the built-ins) below; then list order.
"""

from __future__ import annotations

import pluggy

from . import specs

hookspec = pluggy.HookspecMarker("minisgl")
hookimpl = pluggy.HookimplMarker("minisgl")

#: The hook that declares each component kind.
HOOKS: dict[specs.Kind, str] = {kind: t.hook for kind, t in specs.SPEC_TYPES.items()}


@hookspec
def minisgl_models() -> list[specs.ModelSpec]: ...


@hookspec
def minisgl_attention_backends() -> list[specs.AttentionBackendSpec]: ...


@hookspec
def minisgl_kv_cache_pools() -> list[specs.KVPoolSpec]: ...


@hookspec
def minisgl_prefix_caches() -> list[specs.PrefixCacheSpec]: ...


@hookspec
def minisgl_moe_backends() -> list[specs.MoEBackendSpec]: ...


@hookspec
def minisgl_kernel_sets() -> list[specs.KernelSetSpec]: ...


@hookspec
def minisgl_grammar_backends() -> list[specs.GrammarBackendSpec]: ...


@hookspec
def minisgl_quantization_methods() -> list[specs.QuantizationSpec]: ...
