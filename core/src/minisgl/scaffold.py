"""``minisgl plugin new NAME --kind KIND``: a plugin package that installs, lists and passes its tests as
generated, from ``minisgl/templates/plugin/``: ``common/``, and per kind the entry module ``plugin.py``,
the component's module and ``test.py``."""

from __future__ import annotations

import argparse
import re
import string
import sys
from importlib import resources
from pathlib import Path

from .utils import VERSION

# Per kind: the suffix of the component's class name, and what its test needs besides pytest (the kit's imports).
KINDS: dict[str, tuple[str, str]] = {
    "attention": ("AttnBackend", ""),
    "prefix-cache": ("PrefixCache", "hypothesis>=6.100"),
    "moe": ("MoEBackend", ""),
    "kernels": ("Kernels", ""),
    "grammar": ("GrammarBackend", "tokenizers>=0.19"),
    "quantization": ("Method", ""),
    "model": ("", ""),
}
USAGE = {
    "attention": 'Use it with `minisgl serve --attn {name}` or `LLM(..., attention_backend="{name}")`.',
    "prefix-cache": 'Use it with `minisgl serve --cache {name}` or `LLM(..., prefix_cache="{name}")`.',
    "moe": 'Use it with `minisgl serve --moe-backend {name}` (MoE models) or `LLM(..., moe_backend="{name}")`.',
    "kernels": 'Use it with `minisgl serve --kernels {name}` or `LLM(..., kernels="{name}")`.',
    "grammar": 'Use it with `minisgl serve --grammar-backend {name}` or `LLM(..., grammar_backend="{name}")`.',
    "quantization": 'Checkpoints whose quantization_config says `"quant_method": "{name}"` load with it; or '
    "`minisgl serve --quantization {name}`.",
    "model": "Checkpoints whose config.json names `{architecture}` load with it: `minisgl serve --model PATH`.",
}
# Every kind but models is also chosen by `auto`, among the specs that opt in.
AUTO_NOTE = (
    " It is used only when named: `auto` keeps its choice until the spec in plugin.py sets `auto=True`"
    ' (minisgl\'s docs/plugins.md, "Names, aliases and `auto`").'
)
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class ScaffoldError(ValueError):
    """The package cannot be created; the message says why."""


def create(name: str, kind: str, parent: Path, description: str = "", architecture: str = "") -> Path:
    """Write the package ``minisgl-plugin-NAME`` for a component of ``kind`` under ``parent``; its path.
    A model plugin needs ``architecture``, the Hugging Face class name (``Phi3ForCausalLM``)."""
    if not _NAME.match(name):
        raise ScaffoldError(f"plugin name {name!r} must be lower case letters, digits and '_', starting with a letter")
    if kind not in KINDS:
        raise ScaffoldError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    if kind == "model" and not re.fullmatch(r"[A-Z]\w*For\w+", architecture):
        raise ScaffoldError(
            "a model plugin needs --architecture, the Hugging Face class name (e.g. Phi3ForCausalLM), "
            f"got {architecture!r}"
        )
    dist, module = f"minisgl-plugin-{name.replace('_', '-')}", f"minisgl_plugin_{name}"
    root = parent / dist
    if root.exists():
        raise ScaffoldError(f"{root} already exists; choose another name or folder")
    suffix, test_needs = KINDS[kind]
    major, minor = (int(p) for p in VERSION.split(".")[:2])
    values = {
        "name": name,
        "dist": dist,
        "module": module,
        "cls": architecture if kind == "model" else "".join(p.capitalize() for p in name.split("_")) + suffix,
        "architecture": architecture,
        "description": description or f"the {kind} component '{name}'",
        "test_extra": ", ".join(f'"{r}"' for r in ("pytest>=8", test_needs) if r),
        "api_min": f"{major}.{minor}",
        "api_next": f"{major}.{minor + 1}",
        "usage": USAGE[kind].format(name=name, architecture=architecture) + ("" if kind == "model" else AUTO_NOTE),
    }
    templates = resources.files("minisgl") / "templates" / "plugin"
    files = {t.name.removesuffix(".tmpl"): t for t in (templates / "common").iterdir()}  # pyproject.toml, README.md
    for template in (templates / kind).iterdir():  # plugin.py, test.py and the component's module
        stem = template.name.removesuffix(".py.tmpl")
        files[f"tests/test_{name}.py" if stem == "test" else f"src/{module}/{stem}.py"] = template
    for rel, template in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(string.Template(template.read_text()).substitute(values))
    (root / "src" / module / "__init__.py").write_text(f'"""{dist}: {values["description"]}."""\n')
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minisgl plugin", description="Create a minisgl plugin package.")
    sub = parser.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="write a new plugin package that passes its tests as generated")
    new.add_argument("name", help="the component's name, e.g. mykernel (package minisgl-plugin-mykernel)")
    new.add_argument("--kind", required=True, choices=list(KINDS), help="what the plugin provides")
    new.add_argument("--dir", type=Path, default=Path("."), help="folder to create the package in (default: .)")
    new.add_argument("--description", default="", help="one line shown by `minisgl plugins`")
    new.add_argument(
        "--architecture", default="", help="--kind model: the Hugging Face class name, e.g. Phi3ForCausalLM"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        root = create(args.name, args.kind, args.dir, args.description, args.architecture)
    except ScaffoldError as exc:
        print(f"minisgl plugin: error: {exc}", file=sys.stderr)
        return 2
    print(f"created {root}\nnext: cd {root} && pip install -e '.[test]' && minisgl plugins && pytest")
    return 0
