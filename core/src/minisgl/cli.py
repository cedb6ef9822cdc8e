"""The ``minisgl`` command: a thin dispatcher (each subcommand's module is imported only when used, so
``--help`` stays fast). ``bench`` is the separate package minisgl-bench; without it, the command says how
to install it."""

from __future__ import annotations

import importlib
import os
import sys

from .utils import VERSION

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("minisgl.server.cli", "start the OpenAI-compatible API server"),
    "chat": ("minisgl.server.chat", "chat with a model in the terminal"),
    "plugins": ("minisgl.plugins.listing", "list installed plugins and what they provide"),
    "cache": ("minisgl.utils.cache", "list, size or clear the cache of converted GGUF models and built kernels"),
    "plugin": ("minisgl.scaffold", "create a plugin package: minisgl plugin new NAME --kind KIND"),
    "bench": ("minisgl_bench.cli", "run a benchmark (offline throughput, serving); needs minisgl-bench"),
}
# Subcommands of another distribution: (its name, its path in the source tree).
SEPARATE: dict[str, tuple[str, str]] = {"bench": ("minisgl-bench", "benchmarks/minisgl-bench")}


def _usage() -> str:
    lines = [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    hint = "Run 'minisgl <command> --help' for the options of a command."
    return "\n".join(["usage: minisgl <command> [options]", "", "commands:", *lines, "", hint])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        print(f"minisgl {VERSION}")
        return 0
    entry = SUBCOMMANDS.get(args[0])
    if entry is None:
        print(f"minisgl: unknown command '{args[0]}'\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(entry[0])
    except ModuleNotFoundError as exc:
        separate = SEPARATE.get(args[0])
        if separate is None or exc.name not in (entry[0].split(".")[0], entry[0]):
            raise
        print(
            f"minisgl {args[0]}: this command is the separate package {separate[0]}, which is not installed.\n"
            f"Install it from the minisgl source tree: pip install ./{separate[1]}",
            file=sys.stderr,
        )
        return 2
    try:
        code = int(module.main(args[1:]) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        # The reader went away (`minisgl plugins --json | head`): stop quietly, as other tools do.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by the pipe


if __name__ == "__main__":
    sys.exit(main())
