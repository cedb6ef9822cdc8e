"""Plugin discovery and the registries built from it.

:func:`load_plugins` finds modules registered under the ``minisgl`` entry-point
group, imports them, calls their hooks once and returns a :class:`PluginRegistry`:
plain dictionaries from component names to specs. There is no module-level
state: every engine (and every test) may build its own registry.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import os
import types
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy

from . import hookspecs
from .specs import ALL_SPEC_TYPES, ComponentSpec, Kind

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "minisgl"
BUILTIN = "builtin"

Status = Literal["active", "disabled", "failed", "incompatible"]

_HOOKS: dict[Kind, str] = {
    "model": "minisgl_models",
    "attention": "minisgl_attention_backends",
    "kv_pool": "minisgl_kv_cache_pools",
    "prefix_cache": "minisgl_prefix_caches",
    "moe": "minisgl_moe_backends",
}

KIND_LABELS: dict[Kind, str] = {
    "model": "model architecture",
    "attention": "attention backend",
    "kv_pool": "KV cache pool",
    "prefix_cache": "prefix cache",
    "moe": "MoE backend",
}

# Components published by the project's own plugin packages, so that a name that
# is known but not installed gets an actionable "pip install ..." hint.
KNOWN_PROVIDERS: dict[str, str] = {
    "flashinfer": "minisgl-plugin-flashinfer",
    "fi": "minisgl-plugin-flashinfer",
    "fa": "minisgl-plugin-fa",
    "trtllm": "minisgl-plugin-trtllm",
    "radix": "minisgl-plugin-radix",
    "fused": "minisgl-plugin-qwen3-moe",
    "LlamaForCausalLM": "minisgl-plugin-llama",
    "MistralForCausalLM": "minisgl-plugin-llama",
    "Qwen2ForCausalLM": "minisgl-plugin-llama",
    "Qwen3ForCausalLM": "minisgl-plugin-llama",
    "Qwen3MoeForCausalLM": "minisgl-plugin-qwen3-moe",
}


class PluginError(RuntimeError):
    """A plugin could not be loaded, or two plugins conflict."""


class UnknownComponentError(LookupError):
    """A requested component name is not provided by any active plugin."""

    def __str__(self) -> str:  # LookupError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


@dataclass
class PluginInfo:
    """One entry point of the ``minisgl`` group and what became of it."""

    name: str
    distribution: str
    version: str
    module: str
    status: Status
    error: str = ""
    provides: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.module,
            "status": self.status,
            "error": self.error,
            "provides": self.provides,
        }


@dataclass(frozen=True)
class Provided:
    spec: ComponentSpec
    plugin: PluginInfo


class PluginRegistry:
    """Registries of every component kind, resolved once from the active plugins."""

    def __init__(self, plugins: list[PluginInfo], components: dict[Kind, dict[str, Provided]]):
        self.plugins = plugins
        self._components = components
        self._aliases: dict[Kind, dict[str, str]] = {k: {} for k in components}
        for kind, entries in components.items():
            for name, provided in entries.items():
                for alias in provided.spec.aliases:
                    self._aliases[kind][alias] = name

    def active_plugin_names(self) -> list[str]:
        """Entry names of the active plugins (handed to worker processes)."""
        return [p.name for p in self.plugins if p.status == "active"]

    def names(self, kind: Kind) -> list[str]:
        return sorted(self._components[kind])

    def has(self, kind: Kind, name: str) -> bool:
        return name in self._components[kind] or name in self._aliases[kind]

    def get(self, kind: Kind, name: str) -> ComponentSpec:
        """The spec registered for ``name`` (or an alias); a clear error otherwise."""
        canonical = self._aliases[kind].get(name, name)
        provided = self._components[kind].get(canonical)
        if provided is not None:
            return provided.spec
        raise UnknownComponentError(self._unknown_message(kind, name))

    def provider(self, kind: Kind, name: str) -> PluginInfo:
        canonical = self._aliases[kind].get(name, name)
        return self._components[kind][canonical].plugin

    def pick(self, kind: Kind, name: str, device: str) -> ComponentSpec:
        """Resolve ``name`` ("auto" = best supported by priority) for ``device``."""
        if name != "auto":
            spec = self.get(kind, name)
            if not spec.supports(device):
                raise UnknownComponentError(
                    f"{KIND_LABELS[kind]} '{spec.name}' does not support device '{device}'; "
                    f"supported there: {', '.join(self.supported(kind, device)) or 'none'}"
                )
            return spec
        candidates = [p.spec for p in self._components[kind].values() if p.spec.supports(device)]
        if not candidates:
            raise UnknownComponentError(
                f"no installed {KIND_LABELS[kind]} supports device '{device}'; "
                f"installed: {self._installed_text(kind)}"
            )
        return max(candidates, key=lambda s: (s.priority, s.name))

    def supported(self, kind: Kind, device: str) -> list[str]:
        return sorted(n for n, p in self._components[kind].items() if p.spec.supports(device))

    def _installed_text(self, kind: Kind) -> str:
        parts = []
        for name in self.names(kind):
            dist = self._components[kind][name].plugin.distribution
            parts.append(f"{name} ({dist})")
        return ", ".join(parts) or "none"

    def _unknown_message(self, kind: Kind, name: str) -> str:
        msg = f"unknown {KIND_LABELS[kind]} '{name}'; installed: {self._installed_text(kind)}"
        package = KNOWN_PROVIDERS.get(name)
        if package is not None:
            disabled = [p for p in self.plugins if p.distribution == package and p.status != "active"]
            if disabled:
                p = disabled[0]
                msg += f". It is provided by {package}, which is installed but {p.status}"
                msg += f" ({p.error})" if p.error else ""
            else:
                msg += f". '{name}' is provided by {package}: pip install {package}"
        return msg


def _split_env(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def _core_version() -> str:
    try:
        return md.version("minisgl")
    except md.PackageNotFoundError:
        return "0.0.0"


def _compatible(dist: md.Distribution | None, core_version: str) -> tuple[bool, str]:
    """Check a plugin distribution's declared requirement on ``minisgl``."""
    if dist is None:
        return True, ""
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # pragma: no cover - packaging ships with pip/transformers
        return True, ""
    for raw in dist.requires or []:
        try:
            req = Requirement(raw)
        except Exception:
            continue
        if req.name.lower() == "minisgl" and not req.marker:
            if req.specifier and not req.specifier.contains(Version(core_version), prereleases=True):
                return False, f"requires minisgl{req.specifier}, found {core_version}"
    return True, ""


@dataclass(frozen=True)
class PluginSource:
    """A plugin to load: an entry name and either a module path or a module object."""

    name: str
    module: str | types.ModuleType | object
    distribution: str = ""
    version: str = ""
    dist: md.Distribution | None = None


def discover() -> list[PluginSource]:
    """Every entry point of the ``minisgl`` group, built-ins first."""
    sources: list[PluginSource] = []
    seen: set[str] = set()
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in seen:  # the same distribution seen twice on sys.path
            continue
        seen.add(ep.name)
        dist = ep.dist
        sources.append(
            PluginSource(
                name=ep.name,
                module=ep.value,
                distribution=dist.metadata["Name"] if dist is not None else "",
                version=dist.version if dist is not None else "",
                dist=dist,
            )
        )
    if BUILTIN not in seen:  # running from a source tree without installed metadata
        sources.append(PluginSource(BUILTIN, "minisgl.plugins.builtin", "minisgl", _core_version()))
    sources.sort(key=lambda s: (s.name != BUILTIN, s.name))
    return sources


def load_plugins(
    only: Sequence[str] | None = None,
    *,
    extra: Iterable[PluginSource] = (),
    environ: Mapping[str, str] | None = None,
    strict: bool | None = None,
) -> PluginRegistry:
    """Discover, filter, import and resolve plugins into a :class:`PluginRegistry`.

    ``only`` loads exactly the named entry points (used by worker processes,
    which receive the list from their parent). ``extra`` adds plugins that are
    not installed as entry points (useful in tests). ``environ`` defaults to
    ``os.environ`` and is read for ``MINISGL_PLUGINS``, ``MINISGL_DISABLE_PLUGINS``
    and ``MINISGL_STRICT_PLUGINS``.
    """
    env = os.environ if environ is None else environ
    if strict is None:
        strict = env.get("MINISGL_STRICT_PLUGINS", "") not in ("", "0", "false", "False")
    allow = _split_env(env.get("MINISGL_PLUGINS"))
    block = _split_env(env.get("MINISGL_DISABLE_PLUGINS")) or []
    sources = discover() + list(extra)
    known = {s.name for s in sources}
    for label, names in (("MINISGL_PLUGINS", allow or []), ("MINISGL_DISABLE_PLUGINS", block)):
        for n in names:
            if n not in known:
                warnings.warn(f"{label} names unknown plugin '{n}'; installed: {', '.join(sorted(known))}", stacklevel=2)

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    core_version = _core_version()
    infos: list[PluginInfo] = []
    modules: list[tuple[PluginInfo, object]] = []
    for src in sources:
        module_name = src.module if isinstance(src.module, str) else getattr(src.module, "__name__", repr(src.module))
        info = PluginInfo(src.name, src.distribution, src.version, module_name, "active")
        infos.append(info)
        if only is not None:
            enabled = src.name in only
        else:
            enabled = src.name == BUILTIN or ((allow is None or src.name in allow) and src.name not in block)
        if not enabled:
            info.status = "disabled"
            continue
        ok, why = _compatible(src.dist, core_version)
        if not ok:
            info.status, info.error = "incompatible", why
            _report(f"plugin '{src.name}' ({src.distribution}) is incompatible: {why}; skipped", strict)
            continue
        try:
            module = importlib.import_module(src.module.partition(":")[0]) if isinstance(src.module, str) else src.module
            pm.register(module, name=src.name)
        except Exception as exc:
            info.status, info.error = "failed", f"{type(exc).__name__}: {exc}"
            _report(f"plugin '{src.name}' ({src.distribution or module_name}) failed to load: {info.error}; skipped", strict)
            continue
        modules.append((info, module))

    components: dict[Kind, dict[str, Provided]] = {k: {} for k in ALL_SPEC_TYPES}
    for info, module in modules:
        try:
            provided = _collect(module)
        except Exception as exc:
            info.status, info.error = "failed", f"{type(exc).__name__}: {exc}"
            _report(f"plugin '{info.name}' ({info.distribution or info.module}) hook failed: {info.error}; skipped", strict)
            continue
        for kind, specs in provided.items():
            for spec in specs:
                _add(components[kind], kind, spec, info)
                info.provides.setdefault(kind, []).append(spec.name)
    return PluginRegistry(infos, components)


def _collect(module: object) -> dict[Kind, list[ComponentSpec]]:
    out: dict[Kind, list[ComponentSpec]] = {}
    for kind, hook in _HOOKS.items():
        fn = getattr(module, hook, None)
        if fn is None:
            continue
        specs = list(fn() or [])
        expected = ALL_SPEC_TYPES[kind]
        for spec in specs:
            if not isinstance(spec, expected):
                raise TypeError(f"{hook}() returned {type(spec).__name__}, expected {expected.__name__}")
        out[kind] = specs
    return out


def _add(table: dict[str, Provided], kind: Kind, spec: ComponentSpec, info: PluginInfo) -> None:
    names = (spec.name, *spec.aliases)
    for n in names:
        clash = table.get(n) or next((p for p in table.values() if n in p.spec.aliases), None)
        if clash is None:
            continue
        if spec.override and not clash.spec.override:
            warnings.warn(
                f"{KIND_LABELS[kind]} '{n}' from {_who(info)} overrides the one from {_who(clash.plugin)}",
                stacklevel=3,
            )
            table.pop(clash.spec.name, None)
            continue
        if clash.spec.override and not spec.override:
            warnings.warn(
                f"{KIND_LABELS[kind]} '{n}' from {_who(clash.plugin)} overrides the one from {_who(info)}",
                stacklevel=3,
            )
            return
        raise PluginError(
            f"{KIND_LABELS[kind]} '{n}' is provided by both {_who(clash.plugin)} and {_who(info)}; "
            f"uninstall or disable one (MINISGL_DISABLE_PLUGINS=<entry name>), "
            f"or mark exactly one spec override=True"
        )
    table[spec.name] = Provided(spec, info)


def _who(info: PluginInfo) -> str:
    return f"plugin '{info.name}' ({info.distribution})" if info.distribution else f"plugin '{info.name}'"


def _report(message: str, strict: bool) -> None:
    if strict:
        raise PluginError(message + " (MINISGL_STRICT_PLUGINS is set)")
    warnings.warn(message, stacklevel=3)
