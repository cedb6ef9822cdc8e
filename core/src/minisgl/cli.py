"""The ``minisgl`` command: a thin dispatcher, so ``--help`` stays fast.

Each subcommand lives in its own module and is imported only when used.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("minisgl.server.cli", "start the OpenAI-compatible API server"),
    "chat": ("minisgl.server.chat", "chat with a model in the terminal"),
    "plugins": ("minisgl.plugins.listing", "list installed plugins and what they provide"),
    "bench": ("minisgl.benchmark.cli", "run a benchmark (offline throughput, serving)"),
}


def _usage() -> str:
    lines = ["usage: minisgl <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run 'minisgl <command> --help' for the options of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        from . import __version__

        print(f"minisgl {__version__}")
        return 0
    entry = SUBCOMMANDS.get(args[0])
    if entry is None:
        print(f"minisgl: unknown command '{args[0]}'\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(entry[0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
