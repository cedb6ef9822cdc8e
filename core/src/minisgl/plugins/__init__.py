"""The plugin layer: hook specs, spec dataclasses and the plugin loader.

This package imports only the standard library and pluggy, so a plugin's entry
module (which imports ``minisgl.plugins``) stays cheap to load.
"""

from .hookspecs import hookimpl, hookspec
from .manager import (
    ENTRY_POINT_GROUP,
    PluginError,
    PluginInfo,
    PluginRegistry,
    PluginSource,
    UnknownComponentError,
    load_plugins,
)
from .specs import (
    AttentionBackendSpec,
    ComponentSpec,
    KVPoolSpec,
    ModelSpec,
    MoEBackendSpec,
    PrefixCacheSpec,
    resolve,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "AttentionBackendSpec",
    "ComponentSpec",
    "KVPoolSpec",
    "ModelSpec",
    "MoEBackendSpec",
    "PluginError",
    "PluginInfo",
    "PluginRegistry",
    "PluginSource",
    "PrefixCacheSpec",
    "UnknownComponentError",
    "hookimpl",
    "hookspec",
    "load_plugins",
    "resolve",
]
