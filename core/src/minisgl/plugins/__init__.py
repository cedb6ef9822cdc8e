"""The plugin layer: hook specs, spec dataclasses, the plugin loader and registries.

This package imports only the standard library and pluggy (``packaging`` when a
plugin declares a requirement on minisgl), so a plugin's entry module, which
imports ``minisgl.plugins``, stays cheap to load. See docs/plugins.md.
"""

from .devices import cuda_capabilities
from .errors import PluginError, PluginWarning, UnknownComponentError
from .hookspecs import HOOKS, hookimpl, hookspec
from .manager import (
    BUILTIN,
    ENTRY_POINT_GROUP,
    PluginSource,
    check_compatible,
    core_version,
    discover,
    load_plugins,
)
from .registry import KNOWN_PROVIDERS, PluginInfo, PluginRegistry
from .specs import (
    KIND_LABELS,
    KINDS,
    AttentionBackendSpec,
    ComponentSpec,
    Kind,
    KVPoolSpec,
    ModelSpec,
    MoEBackendSpec,
    PrefixCacheSpec,
    Unsupported,
    resolve,
)

__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "HOOKS",
    "KINDS",
    "KIND_LABELS",
    "KNOWN_PROVIDERS",
    "AttentionBackendSpec",
    "ComponentSpec",
    "KVPoolSpec",
    "Kind",
    "ModelSpec",
    "MoEBackendSpec",
    "PluginError",
    "PluginInfo",
    "PluginRegistry",
    "PluginSource",
    "PluginWarning",
    "PrefixCacheSpec",
    "UnknownComponentError",
    "Unsupported",
    "check_compatible",
    "cuda_capabilities",
    "core_version",
    "discover",
    "hookimpl",
    "hookspec",
    "load_plugins",
    "resolve",
]
