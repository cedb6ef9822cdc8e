"""``minisgl bench SUBCOMMAND`` (or ``minisgl-bench SUBCOMMAND``): dispatch to the benchmark programs.

Each program is imported only when used.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS: dict[str, tuple[str, str]] = {
    "offline": ("minisgl_bench.offline", "offline throughput (GPU protocol workload, or --workload cpu)"),
    "shared-prefix": ("minisgl_bench.shared_prefix", "prefix-cache benchmark: prompts sharing long prefixes"),
    "serve": ("minisgl_bench.serve", "online serving: a streaming client for any OpenAI-compatible server"),
    "roofline": ("minisgl_bench.roofline", "the offline workload's hardware floor for a model shape and precision"),
    "steps": ("minisgl_bench.steps_report", "where a server's step time went, per run (from --trace-steps)"),
    "plot": (
        "minisgl_bench.serve_plot",
        "plot bench serve results: throughput vs TTFT, a rate sweep, a run's timeline",
    ),
}


def _usage() -> str:
    lines = ["usage: minisgl bench <benchmark> [options]  (or: minisgl-bench <benchmark> [options])", ""]
    lines += ["benchmarks:"]
    lines += [f"  {name:<14} {help_}" for name, (_, help_) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    entry = BENCHMARKS.get(args[0])
    if entry is None:
        print(f"minisgl bench: unknown benchmark '{args[0]}'\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(entry[0])
    return int(module.main(args[1:]) or 0)
