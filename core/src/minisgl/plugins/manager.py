"""Plugin loading: pluggy imports the entry points and calls the hooks; the result is ordered by its call order.

:func:`load_plugins` lists the ``minisgl`` entry points, filters them (allow/block lists, the core
version a plugin requires), has pluggy load each one that passes, calls each plugin's hooks and
returns a :class:`~minisgl.plugins.registry.PluginRegistry`. There is no module-level state.
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

import pluggy

from ..utils import VERSION
from . import hookspecs
from .registry import PluginInfo, PluginRegistry
from .specs import ComponentSpec, PluginError, PluginWarning

ENTRY_POINT_GROUP = "minisgl"
BUILTIN = "builtin"
ENV_ALLOW, ENV_BLOCK, ENV_STRICT = "MINISGL_PLUGINS", "MINISGL_DISABLE_PLUGINS", "MINISGL_STRICT_PLUGINS"
SPEC_TYPES = {t.kind: t for t in ComponentSpec.__subclasses__()}


@dataclass(frozen=True)
class PluginSource:
    """A plugin to load: one per installed entry point (``dist`` set), or given through
    ``load_plugins(extra=[...])`` (tests, embedding), where ``requires`` stands in for ``Requires-Dist``."""

    name: str
    module: str | types.ModuleType | object
    distribution: str = ""
    version: str = ""
    dist: md.Distribution | None = None
    requires: tuple[str, ...] = ()


def core_version() -> str:
    return VERSION


def discover() -> list[PluginSource]:
    """Every installed entry point of the group, built-ins first, then by entry name."""
    # The built-ins' fallback serves a source tree without installed metadata.
    found = {(BUILTIN, "minisgl"): PluginSource(BUILTIN, "minisgl.plugins.builtin", "minisgl", VERSION)}
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):  # one distribution reachable twice counts once
        if dist := ep.dist:
            requires = tuple(dist.requires or ())
            found[ep.name, dist.name] = PluginSource(ep.name, ep.value, dist.name, dist.version, dist, requires)
    return sorted(found.values(), key=lambda s: (s.name != BUILTIN, s.name, s.distribution))


def check_compatible(requirements: Iterable[str], version: str) -> str:
    """Why a plugin requiring ``requirements`` cannot run on core ``version`` ('' if it can)."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
        from packaging.version import Version
    except ImportError:  # packaging comes with pip; without it, trust the installer
        return ""
    for raw in requirements:
        try:
            req = Requirement(raw)
        except InvalidRequirement:
            continue
        if req.name.lower().replace("_", "-") != "minisgl" or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        if not req.specifier.contains(Version(version), prereleases=True):
            return f"requires minisgl{req.specifier}, but minisgl {version} is installed"
    return ""


def load_plugins(
    only: Sequence[str] | None = None,
    *,
    extra: Iterable[PluginSource] = (),
    environ: Mapping[str, str] | None = None,
    strict: bool | None = None,
    raise_conflicts: bool = True,
    discover_installed: bool = True,
) -> PluginRegistry:
    """Load the plugins into a new :class:`PluginRegistry` (docs/plugins.md, "Choosing plugins").

    ``only``: exactly these entry names, ignoring the environment's lists (worker processes).
    ``extra``: plugins that are not installed. ``environ`` (default ``os.environ``) is read for
    ``MINISGL_PLUGINS``, ``MINISGL_DISABLE_PLUGINS`` and ``MINISGL_STRICT_PLUGINS``. ``strict``: a
    plugin that fails or is incompatible raises :class:`PluginError` instead of a warning.
    ``raise_conflicts=False`` keeps the first of two clashing specs and records the clash in
    ``registry.conflicts``. ``discover_installed=False`` loads only ``extra`` (not even the built-ins).
    """
    env = os.environ if environ is None else environ
    strict = _flag(env.get(ENV_STRICT)) if strict is None else strict
    allow, block = _names(env.get(ENV_ALLOW)), _names(env.get(ENV_BLOCK)) or []
    sources = (discover() if discover_installed else []) + list(extra)
    known = sorted({s.name for s in sources})
    lists = {"the plugin list": list(only)} if only is not None else {ENV_ALLOW: allow or [], ENV_BLOCK: block}
    for label, unknown in ((label, n) for label, names in lists.items() for n in names if n not in known):
        close = difflib.get_close_matches(unknown, known, n=1)
        warnings.warn(
            f"{label} names unknown plugin '{unknown}'{f' (did you mean {close[0]!r}?)' if close else ''}; "
            f"installed plugins: {', '.join(known) or 'none'}",
            PluginWarning,
            stacklevel=2,
        )
    pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
    pm.add_hookspecs(hookspecs)
    registry, owners, found = PluginRegistry(), dict[str, PluginInfo](), []
    for src in sources:
        module = src.module if isinstance(src.module, str) else str(getattr(src.module, "__name__", src.module))
        info = PluginInfo(src.name, src.distribution, src.version, module)
        registry.plugins.append(info)
        if only is not None:
            off = "" if src.name in only else "not in the plugin list this process was given"
        else:
            off = f"listed in {ENV_BLOCK}" if src.name in block else ""
            off = off or (f"not in {ENV_ALLOW}" if allow is not None and src.name not in (*allow, BUILTIN) else "")
        if off:
            pm.set_blocked(src.name)  # pluggy never loads a blocked name
            info.status, info.error = "disabled", off
        elif (first := owners.setdefault(src.name, info)) is not info:
            info.status, info.error = "failed", f"entry name '{src.name}' is taken by {first.who}"
            registry.conflicts.append(
                f"two installed distributions register the plugin entry name '{src.name}': {first.who} and "
                f"{info.who}; uninstall one of them"
            )
        elif why := check_compatible(src.requires, VERSION):
            info.status = "incompatible"
            info.error = (
                f"{why}: install a release of {src.distribution or 'it'} made for minisgl {VERSION}, "
                f"or disable it with {ENV_BLOCK}={src.name}"
            )
            _report(f"{info.who} is incompatible: {info.error}", strict)
        else:
            found += _load(pm, src, info, strict)
    for info, hook, specs in found:  # ranked by where pluggy calls each plugin: tryfirst first, trylast last
        order = [impl.plugin_name for impl in reversed(getattr(pm.hook, hook).get_hookimpls())]
        for i, spec in enumerate(specs):
            registry.add(spec, info, (order.index(info.name), i))
    if registry.conflicts and raise_conflicts:
        raise PluginError("conflicting plugins:\n  " + "\n  ".join(registry.conflicts))
    return registry


def _load(
    pm: pluggy.PluginManager, src: PluginSource, info: PluginInfo, strict: bool
) -> list[tuple[PluginInfo, str, list[ComponentSpec]]]:
    """Import the plugin (through pluggy's entry-point loading when installed), register it and call
    its hooks, one plugin at a time so that every spec is attributed to it and a failure drops it alone."""
    stage, found = f" failed to import '{info.module}'", []
    try:
        if src.dist is None:
            plugin = importlib.import_module(src.module) if isinstance(src.module, str) else src.module
        elif not pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=src.name):
            raise LookupError(f"pluggy found no entry point '{src.name}' in the group '{ENTRY_POINT_GROUP}'")
        stage = " is not a valid minisgl plugin"
        if src.dist is None:
            pm.register(plugin, name=src.name)
        plugin = pm.get_plugin(src.name)
        for loaded, dist in pm.list_plugin_distinfo():  # pluggy's word on the distribution it loaded
            if loaded is plugin:
                info.distribution, info.version = dist.project_name, dist.version
        for caller in pm.get_hookcallers(plugin) or []:
            if caller.spec is None:  # a misspelled hook would otherwise be ignored silently
                close = difflib.get_close_matches(caller.name, hookspecs.HOOKS.values(), n=1)
                raise PluginError(
                    f"@hookimpl function '{caller.name}' is not a minisgl hook (known: "
                    f"{', '.join(hookspecs.HOOKS.values())}){f'; did you mean {close[0]!r}?' if close else ''}"
                )
        stage, others = ": a hook failed", [p for p in pm.get_plugins() if p is not plugin]
        for kind, hook in hookspecs.HOOKS.items():
            expected = SPEC_TYPES[kind].__name__
            for result in pm.subset_hook_caller(hook, others)():
                if isinstance(result, ComponentSpec) or not isinstance(result, Iterable):
                    raise TypeError(f"{hook}() must return an iterable of {expected}, got {type(result).__name__}")
                specs = list(result)
                if wrong := [s for s in specs if not isinstance(s, SPEC_TYPES[kind])]:
                    raise TypeError(f"{hook}() returned a {type(wrong[0]).__name__}, expected {expected}")
                found.append((info, hook, specs))
    except Exception as exc:
        if pm.has_plugin(src.name):
            pm.unregister(name=src.name)
        info.status, info.error = "failed", f"{type(exc).__name__}: {exc}"
        _report(f"{info.who}{stage}: {info.error}", strict)
        return []
    return found


def _names(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def _report(message: str, strict: bool) -> None:
    if strict:
        raise PluginError(f"{message} ({ENV_STRICT} is set, so this stops start-up)")
    warnings.warn(
        f"{message}; the plugin is skipped (set {ENV_STRICT}=1 to make this fatal)", PluginWarning, stacklevel=4
    )
