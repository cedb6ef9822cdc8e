"""Plugin discovery and loading.

:func:`load_plugins` finds modules registered under the ``minisgl`` entry-point
group, filters them (allow/block lists, core version), imports them, calls their
hooks once and returns a :class:`~minisgl.plugins.registry.PluginRegistry`.
There is no module-level state: every engine (and every test) may build its own.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import os
import types
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pluggy

from . import hookspecs
from .errors import PluginError, PluginWarning
from .registry import PluginInfo, PluginRegistry, RegistryBuilder
from .specs import ALL_SPEC_TYPES, ComponentSpec, Kind

ENTRY_POINT_GROUP = "minisgl"
BUILTIN = "builtin"
ENV_ALLOW = "MINISGL_PLUGINS"
ENV_BLOCK = "MINISGL_DISABLE_PLUGINS"
ENV_STRICT = "MINISGL_STRICT_PLUGINS"


@dataclass(frozen=True)
class PluginSource:
    """A plugin to load: an entry name and a module (import path or object).

    :func:`discover` makes one per installed entry point; tests and embedders
    pass their own through ``load_plugins(extra=[...])``. ``requires`` stands in
    for a distribution's ``Requires-Dist`` lines when there is no ``dist``.
    """

    name: str
    module: str | types.ModuleType | object
    distribution: str = ""
    version: str = ""
    dist: md.Distribution | None = None
    requires: tuple[str, ...] = ()

    @property
    def module_name(self) -> str:
        if isinstance(self.module, str):
            return self.module
        return str(getattr(self.module, "__name__", type(self.module).__name__))

    def requirements(self) -> list[str]:
        if self.dist is not None:
            return list(self.dist.requires or [])
        return list(self.requires)

    def import_module(self) -> object:
        if not isinstance(self.module, str):
            return self.module
        # "pkg.mod:attr" entry points name an object inside the module (a class instance works too).
        module_name, _, attr = self.module.partition(":")
        obj: Any = importlib.import_module(module_name.strip())
        for part in filter(None, attr.strip().split(".")):
            obj = getattr(obj, part)
        return obj


def core_version() -> str:
    """The running minisgl version, as plugins' requirements are checked against it."""
    from .. import __version__

    return __version__


def discover() -> list[PluginSource]:
    """Every entry point of the ``minisgl`` group, built-ins first, then by entry name."""
    sources: list[PluginSource] = []
    seen: set[tuple[str, str]] = set()
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        dist_name = dist.metadata["Name"] if dist is not None else ""
        if (ep.name, dist_name) in seen:  # one distribution reachable twice on sys.path
            continue
        seen.add((ep.name, dist_name))
        sources.append(PluginSource(ep.name, ep.value, dist_name, dist.version if dist is not None else "", dist))
    if not any(s.name == BUILTIN for s in sources):  # a source tree without installed metadata
        sources.append(PluginSource(BUILTIN, "minisgl.plugins.builtin", "minisgl", core_version()))
    sources.sort(key=lambda s: (s.name != BUILTIN, s.name, s.distribution))
    return sources


def check_compatible(requirements: Iterable[str], version: str) -> str:
    """Why a plugin whose requirements are ``requirements`` cannot run on core ``version`` ('' if it can)."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
        from packaging.version import InvalidVersion, Version
    except ImportError:  # packaging comes with pip and transformers; without it, trust the installer
        return ""
    try:
        running = Version(version)
    except InvalidVersion:
        return ""
    for raw in requirements:
        try:
            req = Requirement(raw)
        except InvalidRequirement:
            continue
        if req.name.lower().replace("_", "-") != "minisgl":
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # e.g. "minisgl>=0.2; extra == 'dev'"
        if req.specifier and not req.specifier.contains(running, prereleases=True):
            return f"requires minisgl{req.specifier}, but minisgl {version} is installed"
    return ""


def _split_env(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def _env_flag(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def load_plugins(
    only: Sequence[str] | None = None,
    *,
    extra: Iterable[PluginSource] = (),
    environ: Mapping[str, str] | None = None,
    strict: bool | None = None,
    raise_conflicts: bool = True,
    discover_installed: bool = True,
) -> PluginRegistry:
    """Discover, filter, import and resolve plugins into a :class:`PluginRegistry`.

    ``only``
        Load exactly these entry names, ignoring the environment's lists (worker
        processes get this from their parent's ``registry.active_plugin_names()``).
    ``extra``
        Plugins that are not installed as entry points (tests, embedding).
    ``environ``
        Read for ``MINISGL_PLUGINS`` (allow-list of third-party entry names; set
        but empty = none), ``MINISGL_DISABLE_PLUGINS`` (block-list) and
        ``MINISGL_STRICT_PLUGINS``; defaults to ``os.environ``.
    ``strict``
        A plugin that fails to import or is incompatible raises :class:`PluginError`
        instead of being skipped with a :class:`PluginWarning`. Defaults to
        ``MINISGL_STRICT_PLUGINS``.
    ``raise_conflicts``
        Two plugins providing the same name raise :class:`PluginError` (always at
        engine start-up); ``False`` keeps the first and records the clash in
        ``registry.conflicts`` (for listings).
    ``discover_installed``
        ``False`` loads only ``extra``: nothing installed, not even the built-ins (for tests).
    """
    env = os.environ if environ is None else environ
    if strict is None:
        strict = _env_flag(env.get(ENV_STRICT))
    allow = _split_env(env.get(ENV_ALLOW))
    block = _split_env(env.get(ENV_BLOCK)) or []
    sources = (discover() if discover_installed else []) + list(extra)
    known = sorted({s.name for s in sources})
    requested = [(ENV_ALLOW, allow or []), (ENV_BLOCK, block)] if only is None else [("the plugin list", list(only))]
    for label, names in requested:
        for n in names:
            if n not in known:
                close = difflib.get_close_matches(n, known, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                warnings.warn(
                    f"{label} names unknown plugin '{n}'{hint}; installed plugins: {', '.join(known) or 'none'}",
                    PluginWarning,
                    stacklevel=2,
                )

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    version = core_version()
    infos: list[PluginInfo] = []
    loaded: list[PluginInfo] = []
    conflicts: list[str] = []
    entry_owner: dict[str, PluginInfo] = {}
    for src in sources:
        info = PluginInfo(src.name, src.distribution, src.version, src.module_name, "active")
        infos.append(info)
        if only is not None:
            enabled = src.name in only
        else:
            enabled = src.name not in block and (src.name == BUILTIN or allow is None or src.name in allow)
        if not enabled:
            info.status = "disabled"
            continue
        if src.name in entry_owner:
            info.status, info.error = "failed", f"entry name '{src.name}' is taken by {entry_owner[src.name].who}"
            conflicts.append(
                f"two installed distributions register the plugin entry name '{src.name}': "
                f"{entry_owner[src.name].who} and {info.who}; uninstall one of them"
            )
            continue
        entry_owner[src.name] = info
        why = check_compatible(src.requirements(), version)
        if why:
            info.status, info.error = "incompatible", why
            _report(f"{info.who} is incompatible: {why}. Install a release of it made for minisgl {version}", strict)
            continue
        try:
            plugin = src.import_module()
        except Exception as exc:
            info.status, info.error = "failed", f"{type(exc).__name__}: {exc}"
            _report(f"{info.who} failed to import '{info.module}': {info.error}", strict)
            continue
        try:
            pm.register(plugin, name=src.name)
            _check_hook_names(pm, plugin)
        except Exception as exc:
            if pm.is_registered(plugin):
                pm.unregister(plugin)
            info.status, info.error = "failed", f"{type(exc).__name__}: {exc}"
            _report(f"{info.who} is not a valid minisgl plugin: {info.error}", strict)
            continue
        loaded.append(info)

    builder = RegistryBuilder()
    collected = {info.name: _collect(pm, info, strict) for info in loaded}
    for info in loaded:
        for spec in collected[info.name] or []:
            builder.add(spec, info)
    conflicts += builder.conflicts
    if conflicts and raise_conflicts:
        raise PluginError("conflicting plugins:\n  " + "\n  ".join(conflicts))
    registry = builder.build(infos)
    registry.conflicts = conflicts
    return registry


def _check_hook_names(pm: pluggy.PluginManager, plugin: object) -> None:
    """A misspelled hook would otherwise be ignored silently: reject it with the known names."""
    known = list(hookspecs.HOOKS.values())
    for caller in pm.get_hookcallers(plugin) or []:
        if caller.name not in known:
            close = difflib.get_close_matches(caller.name, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise PluginError(
                f"@hookimpl function '{caller.name}' is not a minisgl hook (known: {', '.join(known)}){hint}"
            )


def _collect(pm: pluggy.PluginManager, info: PluginInfo, strict: bool) -> list[ComponentSpec] | None:
    """Call the plugin's hooks; on any error the whole plugin is marked failed and provides nothing."""
    specs: list[ComponentSpec] = []
    try:
        for kind, hook in hookspecs.HOOKS.items():
            for impl in getattr(pm.hook, hook).get_hookimpls():
                if impl.plugin_name == info.name:
                    specs += _check_result(kind, hook, impl.function())
    except Exception as exc:
        info.status, info.error = "failed", f"{type(exc).__name__}: {exc}"
        _report(f"{info.who}: a hook failed: {info.error}", strict)
        return None
    return specs


def _check_result(kind: Kind, hook: str, result: object) -> list[ComponentSpec]:
    expected = ALL_SPEC_TYPES[kind]
    if result is None:
        return []
    if isinstance(result, ComponentSpec) or not isinstance(result, Iterable):
        raise TypeError(f"{hook}() must return an iterable of {expected.__name__}, got {type(result).__name__}")
    specs = list(result)
    for spec in specs:
        if not isinstance(spec, expected):
            raise TypeError(f"{hook}() returned a {type(spec).__name__}, expected {expected.__name__}")
    return specs


def _report(message: str, strict: bool) -> None:
    if strict:
        raise PluginError(f"{message} ({ENV_STRICT} is set, so this stops start-up)")
    warnings.warn(
        f"{message}; the plugin is skipped (set {ENV_STRICT}=1 to make this fatal)", PluginWarning, stacklevel=3
    )
