"""``minisgl bench plot``: output throughput against p99 time to first token, from ``bench serve`` results.

Each JSON file is one line (its label), with one point per run of its sweep, in the
order of the sweep's request rates (and concurrencies). Needs matplotlib, a
dependency of minisgl-bench.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def _order(run: dict[str, Any]) -> tuple[float, float]:
    rate = math.inf if run["rate"] == "inf" else float(run["rate"])
    return rate, float(run["concurrency"] or math.inf)


def sweep_points(record: dict[str, Any]) -> list[tuple[float, float, str]]:
    """(output tok/s, TTFT p99 ms, point label) of each run with a TTFT, slowest arrivals first."""
    points = []
    for run in sorted(record["runs"], key=_order):
        ttft = run["ttft_ms"]["p99"]
        if ttft is None:
            continue  # no request of this run produced a token
        name = "all at once" if run["rate"] == "inf" else f"{run['rate']:g}/s"
        if run["concurrency"]:
            name = f"c={run['concurrency']}" if run["rate"] == "inf" else f"{name}, c={run['concurrency']}"
        points.append((float(run["output_throughput"]), float(ttft), name))
    return points


def plot(files: list[Path], out: Path, title: str | None = None) -> None:
    """Write the PNG ``out``: one line per file."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("minisgl bench plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path in files:
        record = json.loads(path.read_text())
        points = sweep_points(record)
        if not points:
            print(f"{path}: no run with a time to first token; left out", file=sys.stderr)
            continue
        xs, ys, names = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=record.get("label") or path.stem)
        for x, y, name in points:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("output throughput (tok/s)")
    ax.set_ylabel("TTFT p99 (ms)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run ``minisgl bench plot`` with ``argv`` (default: the command line)."""
    p = argparse.ArgumentParser(prog="minisgl bench plot", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="JSON results of minisgl bench serve")
    p.add_argument("-o", "--output", type=Path, default=Path("serve.png"), help="PNG to write")
    p.add_argument("--title", default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    plot(args.files, args.output, args.title)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
