"""The plugin layer (docs/plugins.md): hooks, specs, loader, registry. It imports only the standard library,
pluggy and ``packaging``, so entry modules stay cheap to load."""

# ruff: noqa: F401, I001  (re-exports, grouped by module)
from .devices import cuda_capabilities
from .hookspecs import HOOKS, hookimpl, hookspec
from .registry import BUILTIN, ENTRY_POINT_GROUP, PluginInfo, PluginRegistry, PluginSource, check_compatible
from .registry import core_version, load_plugins
from .specs import KINDS, AttentionBackendSpec, ComponentSpec, Kind, KVPoolSpec, ModelSpec
from .specs import MoEBackendSpec, PluginError, PluginWarning, PrefixCacheSpec, UnknownComponentError
from .specs import GrammarBackendSpec, KernelSetSpec, QuantizationSpec, Unsupported, resolve
from .quantization import QuantChoice, choose_quantization, quantization_config_of, read_model_config
from .quantization import read_quantization_config
from .firstparty import FIRST_PARTY, install_hint
