"""``minisgl plugins [--json] [--device DEVICE]``: what is installed, active and provided, loaded as an engine
would, nothing built (no torch import); ``--device`` runs the support checks. Exit status 1: an engine would
refuse to start (a clash, or a skipped plugin under strict mode)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, TextIO

from .registry import ENV_ALLOW, ENV_BLOCK, ENV_STRICT, PluginRegistry, _flag, core_version, load_plugins
from .specs import KINDS, AttentionBackendSpec, PluginError, QuantizationSpec, UnknownComponentError


def to_json(
    registry: PluginRegistry, warning_messages: Sequence[str] = (), device: str | None = None
) -> dict[str, Any]:
    """The listing as plain data; with ``device``, each component row says whether it runs there and why not."""
    components: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for kind in KINDS:
        for spec in registry.specs(kind):
            plugin = registry.provider(kind, spec.name)
            row = {"name": spec.name, "aliases": list(spec.aliases), "auto": spec.auto, "priority": spec.priority}
            row |= {"override": spec.override, "description": spec.description, "factory": spec.factory_ref}
            row |= {"plugin": plugin.name, "distribution": plugin.distribution}
            if isinstance(spec, AttentionBackendSpec):
                row["kv_cache_dtypes"] = list(spec.kv_cache_dtypes)  # quantized KV caches it reads too
                row["decode_kv_cache_dtypes"] = list(spec.decode_kv_cache_dtypes)  # ... and 'auto' decodes with it
            if isinstance(spec, QuantizationSpec):
                row |= {"quant_methods": list(spec.quant_methods), "devices": list(spec.devices)}
                row |= {"dtypes": list(spec.dtypes)}
            if device:
                reason = spec.unsupported_reason(device)
                row |= {"supported": reason is None, "unsupported_reason": reason or ""}
            components[kind].append(row)
    plugins = [dataclasses.asdict(p) for p in registry.plugins]
    listing = {"core_version": core_version(), "plugins": plugins, "components": components}
    listing |= {"conflicts": list(registry.conflicts), "warnings": list(warning_messages)}
    return listing | ({"device": device, "auto": auto_choices(registry, device)} if device else {})


def render_table(registry: PluginRegistry, device: str | None = None) -> str:
    """One row per plugin, one line per kind it provides (with ``device``, one more per component
    that cannot run there, with the reason), then what it lost to overrides and its error."""
    rows = []
    for p in registry.plugins:
        detail, unsupported = [], []
        for kind, names in p.provides.items():
            shown = []
            for spec in [registry.get(kind, n) for n in names]:
                a = spec.aliases
                notes = [f"alias{'es' if len(a) > 1 else ''} {', '.join(a)}"] if a else []
                if isinstance(spec, AttentionBackendSpec) and spec.kv_cache_dtypes:
                    notes.append(f"KV cache {', '.join(spec.kv_cache_dtypes)}")
                if isinstance(spec, AttentionBackendSpec) and spec.decode_kv_cache_dtypes:
                    notes.append(f"auto decodes {', '.join(spec.decode_kv_cache_dtypes)} with it")
                shown.append(f"{spec.name} ({'; '.join(notes)})" if notes else spec.name)
                if device and (why := spec.unsupported_reason(device)) is not None:
                    unsupported.append(f"{kind} {spec.name}: unsupported on {device}" + (f": {why}" if why else ""))
            detail.append(f"{kind}: {', '.join(shown)}")
        detail += unsupported + [f"{kind}: {', '.join(names)} (overridden)" for kind, names in p.overridden.items()]
        detail += [p.error] if p.error else []
        rows.append((p.distribution or "-", p.version or "-", p.name, p.status, detail or ["-"]))
    header = ("DISTRIBUTION", "VERSION", "ENTRY", "STATUS")
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(4)]
    out = []
    for *cells, detail in [(*header, ["PROVIDES"]), *rows]:
        out.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)) + "  " + detail[0])
        out += ["  ".join(" " * w for w in widths) + "  " + d for d in detail[1:]]
    if device:
        picks = ", ".join(f"{kind} {name}" for kind, name in auto_choices(registry, device).items())
        out += ["", f"auto on {device}: {picks}"]
    return "\n".join(out)


def auto_choices(registry: PluginRegistry, device: str) -> dict[str, str]:
    """What ``auto`` picks on ``device`` for each kind but models and quantization (before a model's own checks;
    ``-``: none)."""
    picks: dict[str, str] = {}
    for kind in [k for k in KINDS if k not in ("model", "quantization")]:  # a checkpoint names these
        try:
            picks[kind] = registry.ranked(kind, device)[0].name
        except UnknownComponentError:
            picks[kind] = "-"
    return picks


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Print the listing; return 1 when an engine would refuse to start with these plugins, else 0."""
    out, err = stdout or sys.stdout, stderr or sys.stderr
    parser = argparse.ArgumentParser(
        prog="minisgl plugins",
        description="List the installed minisgl plugins, their status and the components each provides.",
        epilog=f"Honours {ENV_ALLOW} (allow-list), {ENV_BLOCK} (block-list) and {ENV_STRICT}.",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    parser.add_argument("--device", metavar="DEVICE", help="also check each component against DEVICE (cpu, cuda)")
    parser.add_argument(
        "--plugin-paths",
        default=os.environ.get("MINISGL_PLUGIN_PATHS"),
        help="also load plugins that are not installed: .py files, folders of them or module names, comma-separated "
        "(as minisgl serve --plugin-paths; env MINISGL_PLUGIN_PATHS)",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            registry = load_plugins(strict=False, raise_conflicts=False, paths=args.plugin_paths)
        except PluginError as exc:  # a --plugin-paths entry that does not exist
            print(f"minisgl plugins: error: {exc}", file=err)
            return 2
    messages = [str(w.message) for w in caught]
    strict = _flag(os.environ.get(ENV_STRICT))
    skipped = [p for p in registry.plugins if strict and p.status in ("failed", "incompatible")]
    if args.json:
        print(json.dumps(to_json(registry, messages, args.device), indent=2), file=out)
    else:
        print(render_table(registry, args.device), file=out)
    for line in [f"warning: {m}" for m in messages] + [f"error: {c}" for c in registry.conflicts]:
        print(line, file=err)
    for p in skipped:
        print(f"error: {p.who} is {p.status} and {ENV_STRICT} is set, so an engine would not start", file=err)
    return 1 if registry.conflicts or skipped else 0


if __name__ == "__main__":
    sys.exit(main())
