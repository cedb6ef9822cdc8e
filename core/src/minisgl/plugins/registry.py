""":func:`load_plugins`: pluggy loads the allowed, compatible ``minisgl`` entry points and calls their hooks;
the specs go into a :class:`PluginRegistry`, plain data that engines read (no pluggy on the per-step path)."""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import importlib.util
import os
import types
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import pluggy
from packaging.requirements import InvalidRequirement, Requirement

from ..utils import VERSION
from . import hookspecs
from .firstparty import FIRST_PARTY, install_hint
from .specs import SPEC_TYPES, ComponentSpec, Kind, PluginError, PluginWarning, UnknownComponentError

ENTRY_POINT_GROUP = "minisgl"
BUILTIN = "builtin"
ENV_ALLOW, ENV_BLOCK, ENV_STRICT = "MINISGL_PLUGINS", "MINISGL_DISABLE_PLUGINS", "MINISGL_STRICT_PLUGINS"


@dataclass(frozen=True)
class PluginSource:
    """An installed entry point (``dist`` set), or a plugin given as ``load_plugins(extra=[...])``."""

    name: str
    module: str | types.ModuleType | object
    distribution: str = ""
    version: str = ""
    dist: md.Distribution | None = None
    requires: tuple[str, ...] = ()
    local: bool = False  # named by path or module (``plugin_paths``): enabled whatever the lists say


@dataclass
class PluginInfo:
    """One plugin and what became of it: per kind, the names it ``provides`` and those another plugin's
    ``override=True`` spec replaced (``overridden``); ``error``: why it is not active."""

    name: str
    distribution: str
    version: str
    module: str
    status: Literal["active", "disabled", "failed", "incompatible"] = "active"
    error: str = ""
    provides: dict[Kind, list[str]] = field(default_factory=dict)
    overridden: dict[Kind, list[str]] = field(default_factory=dict)

    @property
    def who(self) -> str:
        """``plugin 'fa' (minisgl-plugin-fa 0.2.0)``: how messages name this plugin."""
        return f"plugin '{self.name}'" + (f" ({self.distribution} {self.version})" if self.distribution else "")


class Entry(NamedTuple):
    spec: ComponentSpec
    plugin: PluginInfo
    rank: tuple[int, int]  # (position of the plugin in pluggy's call order, position in its list)


class PluginRegistry:
    """Every kind's specs; ``plugins``: every plugin found, active or not; ``conflicts``: the clashes."""

    def __init__(self) -> None:
        self.plugins: list[PluginInfo] = []
        self.conflicts: list[str] = []
        self._table: dict[Kind, dict[str, Entry]] = {k: {} for k in SPEC_TYPES}

    def add(self, spec: ComponentSpec, plugin: PluginInfo, rank: tuple[int, int]) -> None:
        """Register ``spec``; a clash of names or aliases is a conflict, unless exactly one of the two
        specs sets ``override=True``: that one wins, with a warning."""
        table, names, new = self._table[spec.kind], {spec.name, *spec.aliases}, Entry(spec, plugin, rank)
        for old in [e for e in table.values() if names & {e.spec.name, *e.spec.aliases}]:
            what = f"{spec.noun} '{min(names & {old.spec.name, *old.spec.aliases})}'"
            if old.plugin is plugin:
                self.conflicts.append(f"{plugin.who} declares {what} twice; give each spec a distinct name and aliases")
                return
            if spec.override == old.spec.override:
                both = "both set override=True" if spec.override else "neither sets override=True"
                self.conflicts.append(
                    f"{what} is provided by both {old.plugin.who} and {plugin.who} ({both}); uninstall one, "
                    f"disable one with {ENV_BLOCK}={plugin.name}, or set override=True on exactly one of the two specs"
                )
                return
            winner, loser = (new, old) if spec.override else (old, new)
            msg = f"{what} from {winner.plugin.who} overrides the one from {loser.plugin.who}"
            warnings.warn(msg, PluginWarning, stacklevel=3)
            loser.plugin.overridden.setdefault(spec.kind, []).append(loser.spec.name)
            if loser is new:
                return
            del table[old.spec.name]
        table[spec.name] = new

    def _find(self, kind: Kind, name: str) -> Entry | None:
        return next((e for e in self._table[kind].values() if name in (e.spec.name, *e.spec.aliases)), None)

    def _entry(self, kind: Kind, name: str) -> Entry:
        if entry := self._find(kind, name):
            return entry
        msg = f"unknown {SPEC_TYPES[kind].noun} '{name}'; installed: {self._installed(kind)}."
        known = [n for e in self._table[kind].values() for n in (e.spec.name, *e.spec.aliases)]
        # Architectures share their suffix ("...ForCausalLM"): compare what precedes it, or every name looks close.
        stem = (lambda n: n.split("For", 1)[0]) if kind == "model" else (lambda n: n)
        installed = {p.distribution: p for p in self.plugins}
        dist = FIRST_PARTY.get(kind, {}).get(name, "")
        if (hint := install_hint(kind, name)) and dist not in installed:
            msg += f" {hint}."
        elif dist in installed and (holder := installed[dist]).status != "active":
            msg += f" '{name}' is provided by {dist}, which is installed but {holder.status}: {holder.error}."
        elif close := difflib.get_close_matches(stem(name), [stem(n) for n in known], n=1, cutoff=0.75):
            msg += f" Did you mean '{next(n for n in known if stem(n) == close[0])}'?"
        elif kind == "model":
            msg += " No installed plugin provides it; docs/plugin-contracts.md#model says how to write one."
        if inactive := [f"{p.name} ({p.status}: {p.error})" for p in self.plugins if p.status != "active"]:
            msg += f" Installed plugins that are not active: {'; '.join(inactive)}."
        msg += " `minisgl plugins` lists each plugin and what it provides; docs/plugins.md says how to add one."
        raise UnknownComponentError(msg)

    def _installed(self, kind: Kind) -> str:
        entries = [self._table[kind][n] for n in self.names(kind)]
        return ", ".join(f"{e.spec.name} ({e.plugin.distribution or e.plugin.name})" for e in entries) or "none"

    def active_plugin_names(self) -> list[str]:
        """Entry names of the active plugins: what a parent hands to its worker processes (``only=``)."""
        return [p.name for p in self.plugins if p.status == "active"]

    def names(self, kind: Kind) -> list[str]:
        return sorted(self._table[kind])

    def has(self, kind: Kind, name: str) -> bool:
        return self._find(kind, name) is not None

    def specs(self, kind: Kind) -> list[ComponentSpec]:
        """Every ``kind`` spec, sorted by name."""
        return [self._table[kind][n].spec for n in self.names(kind)]

    def get(self, kind: Kind, name: str) -> ComponentSpec:
        """The spec for ``name`` or an alias; :class:`UnknownComponentError` saying what there is otherwise."""
        return self._entry(kind, name).spec

    def provider(self, kind: Kind, name: str) -> PluginInfo:
        return self._entry(kind, name).plugin

    def supported(self, kind: Kind, device: str) -> list[str]:
        return [s.name for s in self.specs(kind) if s.supports(device)]

    def pick(self, kind: Kind, name: str, device: str) -> ComponentSpec:
        """``name`` if it runs on ``device`` (else why not); ``"auto"``: the best ranked that does."""
        if name == "auto":
            return self.ranked(kind, device)[0]
        spec = self.get(kind, name)
        if (reason := spec.unsupported_reason(device)) is not None:
            raise UnknownComponentError(
                f"{spec.label} does not support device '{device}'{f' ({reason})' if reason else ''}; "
                f"{spec.noun}s that do: {', '.join(self.supported(kind, device)) or 'none'}"
            )
        return spec

    def ranked(self, kind: Kind, device: str) -> list[ComponentSpec]:
        """The ``kind`` specs that ``auto`` may choose (``auto=True``) and that run on ``device``, best first:
        by ``priority``, then by pluggy's call order of the plugins' hooks (tryfirst ... trylast), then by each
        plugin's list order. A spec without ``auto=True`` is used only when named."""
        entries = sorted(self._table[kind].values(), key=lambda e: (-e.spec.priority, e.rank))
        if found := [e.spec for e in entries if e.spec.auto and e.spec.supports(device)]:
            return found
        noun = SPEC_TYPES[kind].noun
        if by_name := [e.spec.name for e in entries if not e.spec.auto and e.spec.supports(device)]:
            raise UnknownComponentError(
                f"no installed {noun} that 'auto' may choose supports device '{device}'; installed: "
                f"{self._installed(kind)}. {', '.join(by_name)} can be named explicitly (a spec joins 'auto' "
                "with auto=True)"
            )
        raise UnknownComponentError(
            f"no installed {noun} supports device '{device}'; installed: {self._installed(kind)}"
        )


def core_version() -> str:
    return VERSION


def discover() -> list[PluginSource]:
    """Every installed entry point of the group (one per distribution name), built-ins first, then by name."""
    # The built-ins' fallback serves a source tree without installed metadata.
    found = {(BUILTIN, "minisgl"): PluginSource(BUILTIN, "minisgl.plugins.builtin", "minisgl", VERSION)}
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        if dist := ep.dist:
            requires = tuple(dist.requires or ())
            found[ep.name, dist.name] = PluginSource(ep.name, ep.value, dist.name, dist.version, dist, requires)
    return sorted(found.values(), key=lambda s: (s.name != BUILTIN, s.name, s.distribution))


def local_sources(paths: str | None) -> list[PluginSource]:
    """Plugins that are not installed: comma-separated ``.py`` files (each a plugin named after its stem),
    folders of them (every file not starting with ``_``), or module names."""
    found: list[PluginSource] = []
    for item in _names(paths) or []:
        path = Path(item).expanduser()
        if path.is_dir():
            files = sorted(f for f in path.glob("*.py") if not f.name.startswith("_"))
        elif item.endswith(".py") or path.exists():
            if not path.is_file():
                raise PluginError(f"plugin file '{item}' does not exist")
            files = [path]
        else:  # a module name
            found.append(PluginSource(item.rsplit(".", 1)[-1], item, item, local=True))
            continue
        found += [PluginSource(f.stem, str(f.resolve()), str(f.resolve()), local=True) for f in files]
    return found


def check_compatible(requirements: Iterable[str], version: str) -> str:
    """Why a plugin requiring ``requirements`` cannot run on core ``version`` ('' if it can)."""
    for raw in requirements:
        try:
            req = Requirement(raw)
        except InvalidRequirement:
            continue
        if req.name.lower().replace("_", "-") != "minisgl" or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        if not req.specifier.contains(version, prereleases=True):
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
    paths: str | None = None,
) -> PluginRegistry:
    """Load the plugins into a new :class:`PluginRegistry` (docs/plugins.md, "Choosing plugins").

    ``only``: exactly these entry names, ignoring the environment's lists (worker processes); ``extra`` and
    ``paths`` (:func:`local_sources`): plugins that are not installed; ``environ`` (default ``os.environ``):
    where the lists and strict flag are read; ``strict``: a plugin that fails or is incompatible raises
    :class:`PluginError` instead of a warning; ``raise_conflicts=False`` keeps the first of two clashing specs
    and records the clash; ``discover_installed=False`` loads only ``extra`` (not even the built-ins).
    """
    env = os.environ if environ is None else environ
    strict = _flag(env.get(ENV_STRICT)) if strict is None else strict
    allow, block = _names(env.get(ENV_ALLOW)), _names(env.get(ENV_BLOCK)) or []
    sources = (discover() if discover_installed else []) + list(extra) + local_sources(paths)
    known = sorted({s.name for s in sources})
    lists = {"the plugin list": list(only)} if only is not None else {ENV_ALLOW: allow or [], ENV_BLOCK: block}
    for label, unknown in ((label, n) for label, names in lists.items() for n in names if n not in known):
        close = difflib.get_close_matches(unknown, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        msg = f"{label} names unknown plugin '{unknown}'{hint}; installed plugins: {', '.join(known) or 'none'}"
        warnings.warn(msg, PluginWarning, stacklevel=2)
    pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
    pm.add_hookspecs(hookspecs)
    registry, owners, found = PluginRegistry(), dict[str, PluginInfo](), []
    for src in sources:
        module = src.module if isinstance(src.module, str) else str(getattr(src.module, "__name__", src.module))
        info = PluginInfo(src.name, src.distribution, src.version, module)
        registry.plugins.append(info)
        if src.local or (src.name == BUILTIN and only is not None):
            off = ""  # named explicitly (plugin_paths), or the core's own (always on with a plugin list)
        elif only is not None:
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
    for info, kind, specs in found:  # ranked by where pluggy calls each plugin: tryfirst first, trylast last
        order = [impl.plugin_name for impl in reversed(getattr(pm.hook, hookspecs.HOOKS[kind]).get_hookimpls())]
        for i, spec in enumerate(specs):
            registry.add(spec, info, (order.index(info.name), i))
    for kind, table in registry._table.items():
        for name, entry in table.items():
            entry.plugin.provides.setdefault(kind, []).append(name)
    if registry.conflicts and raise_conflicts:
        raise PluginError("conflicting plugins:\n  " + "\n  ".join(registry.conflicts))
    return registry


def _load(
    pm: pluggy.PluginManager, src: PluginSource, info: PluginInfo, strict: bool
) -> list[tuple[PluginInfo, Kind, list[ComponentSpec]]]:
    """Import (through pluggy for installed ones), register and call one plugin: a failure drops it alone."""
    stage, found = f" failed to import '{info.module}'", []
    try:
        if src.dist is None:
            plugin = src.module
            if isinstance(plugin, str):
                plugin = _import_file(plugin) if plugin.endswith(".py") else importlib.import_module(plugin)
            stage = " is not a valid minisgl plugin"
            pm.register(plugin, name=src.name)
        elif not pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=src.name):  # imports and registers it
            raise LookupError(f"pluggy found no entry point '{src.name}' in the group '{ENTRY_POINT_GROUP}'")
        stage, plugin = " is not a valid minisgl plugin", pm.get_plugin(src.name)
        if typos := [c.name for c in pm.get_hookcallers(plugin) or [] if c.spec is None]:
            close = difflib.get_close_matches(typos[0], hookspecs.HOOKS.values(), n=1)
            raise PluginError(
                f"@hookimpl function '{typos[0]}' is not a minisgl hook (known: "
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
                found.append((info, kind, specs))
    except Exception as exc:
        if pm.has_plugin(src.name):
            pm.unregister(name=src.name)
        info.status, info.error = "failed", f"{type(exc).__name__}: {exc}"
        _report(f"{info.who}{stage}: {info.error}", strict)
        return []
    return found


def _import_file(path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"minisgl_local_plugin_{Path(path).stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
