"""The registry built once at start-up from the active plugins' specs; it settles name clashes.

It is plain data (per kind, name -> spec, the plugin that provided it, and its rank under ``auto``):
engines read it, nothing on the per-step path touches pluggy.
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from .specs import KIND_LABELS, KINDS, ComponentSpec, Kind, PluginWarning, UnknownComponentError

Status = Literal["active", "disabled", "failed", "incompatible"]


@dataclass
class PluginInfo:
    """One plugin and what became of it: ``provides`` (per kind, the names it contributes), ``overridden``
    (the names another plugin's ``override=True`` spec replaced), ``error`` (why it is not active)."""

    name: str
    distribution: str
    version: str
    module: str
    status: Status = "active"
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
    """Every kind's specs. ``plugins`` lists every plugin found (active or not); ``conflicts`` the clashes
    (:func:`load_plugins` raises on them unless ``raise_conflicts=False``, for listings)."""

    def __init__(self) -> None:
        self.plugins: list[PluginInfo] = []
        self.conflicts: list[str] = []
        self._table: dict[Kind, dict[str, Entry]] = {k: {} for k in KINDS}

    def add(self, spec: ComponentSpec, plugin: PluginInfo, rank: tuple[int, int] = (0, 0)) -> None:
        """Register ``spec``; a clash with another spec's name or alias is a conflict, unless exactly one
        of the two sets ``override=True``: that one wins, with a warning."""
        kind, table, names, new = (
            spec.kind,
            self._table[spec.kind],
            {spec.name, *spec.aliases},
            Entry(spec, plugin, rank),
        )
        for old in [e for e in table.values() if names & {e.spec.name, *e.spec.aliases}]:
            what = f"{KIND_LABELS[kind]} '{sorted(names & {old.spec.name, *old.spec.aliases})[0]}'"
            if old.plugin is plugin:
                self.conflicts.append(f"{plugin.who} declares {what} twice; give each spec a distinct name and aliases")
                return
            if spec.override == old.spec.override:
                both = "both set override=True" if spec.override else "neither sets override=True"
                self.conflicts.append(
                    f"{what} is provided by both {old.plugin.who} and {plugin.who} ({both}); uninstall one, "
                    f"disable one with MINISGL_DISABLE_PLUGINS={plugin.name}, or set override=True on exactly one "
                    "of the two specs"
                )
                return
            winner, loser = (new, old) if spec.override else (old, new)
            warnings.warn(
                f"{what} from {winner.plugin.who} overrides the one from {loser.plugin.who}",
                PluginWarning,
                stacklevel=4,
            )
            loser.plugin.overridden.setdefault(kind, []).append(loser.spec.name)
            if loser is new:
                return
            del table[old.spec.name]
            old.plugin.provides[kind].remove(old.spec.name)
            if not old.plugin.provides[kind]:
                del old.plugin.provides[kind]
        table[spec.name] = new
        plugin.provides.setdefault(kind, []).append(spec.name)

    def _entry(self, kind: Kind, name: str) -> Entry:
        for entry in self._table[kind].values():
            if name == entry.spec.name or name in entry.spec.aliases:
                return entry
        installed = self._installed(kind)
        msg = f"unknown {KIND_LABELS[kind]} '{name}'; installed: {installed}."
        known = [n for e in self._table[kind].values() for n in (e.spec.name, *e.spec.aliases)]
        if close := difflib.get_close_matches(name, known, n=1, cutoff=0.75):
            msg += f" Did you mean '{close[0]}'?"
        if inactive := [f"{p.name} ({p.status}: {p.error})" for p in self.plugins if p.status != "active"]:
            msg += f" Installed plugins that are not active: {'; '.join(inactive)}."
        raise UnknownComponentError(
            msg + " `minisgl plugins` lists each plugin and what it provides; docs/plugins.md says how to add one."
        )

    def _installed(self, kind: Kind) -> str:
        table = self._table[kind]
        return (
            ", ".join(f"{n} ({table[n].plugin.distribution or table[n].plugin.name})" for n in sorted(table)) or "none"
        )

    def active_plugin_names(self) -> list[str]:
        """Entry names of the active plugins: what a parent hands to its worker processes (``only=``)."""
        return [p.name for p in self.plugins if p.status == "active"]

    def names(self, kind: Kind) -> list[str]:
        return sorted(self._table[kind])

    def has(self, kind: Kind, name: str) -> bool:
        return any(name == e.spec.name or name in e.spec.aliases for e in self._table[kind].values())

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
                f"{KIND_LABELS[kind]}s that do: {', '.join(self.supported(kind, device)) or 'none'}"
            )
        return spec

    def ranked(self, kind: Kind, device: str) -> list[ComponentSpec]:
        """The ``kind`` specs that run on ``device``, best first: by ``priority``, then by pluggy's call
        order of the plugins' hooks (tryfirst ... trylast), then by each plugin's list order."""
        entries = sorted(self._table[kind].values(), key=lambda e: (-e.spec.priority, e.rank))
        if found := [e.spec for e in entries if e.spec.supports(device)]:
            return found
        raise UnknownComponentError(
            f"no installed {KIND_LABELS[kind]} supports device '{device}'; installed: {self._installed(kind)}"
        )
