"""``minisgl bench plot``: draw ``bench serve`` results (frontier, rate sweep, or a run's timeline).

- ``--kind frontier`` (default): output throughput against p99 time to first token, one line
  per file (its label), one point per rate (and concurrency) of its sweep;
- ``--kind sweep``: TTFT p50 and p99, and output throughput, against the request rate, one
  line per label (several files of one label, e.g. one per rate, make one line), the spread
  over repeats as bars, the TTFT target as a line, and the rate where p99 crosses it printed;
- ``--kind timeline``: one record and its server's step trace (``--trace``, default the
  record's own ``LABEL.trace.jsonl.gz``): batch size, step time and each request's TTFT over time.

Points are medians over ``--repeat`` runs. Drawing needs matplotlib (a dependency of
minisgl-bench); the data behind each plot is prepared without it (``serve_summary``,
``serve_trace``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from .serve_summary import aggregate, crossing_line, crossing_rate, rate_value
from .serve_trace import Timeline, read_trace, timeline

KINDS = ("frontier", "sweep", "timeline")


def _point_name(row: dict[str, Any]) -> str:
    name = "all at once" if row["rate"] == "inf" else f"{row['rate']:g}/s"
    if row["concurrency"]:
        name = f"c={row['concurrency']}" if row["rate"] == "inf" else f"{name}, c={row['concurrency']}"
    return name


def _order(row: dict[str, Any]) -> tuple[float, float]:
    return rate_value(row["rate"]), float(row["concurrency"] or math.inf)


def sweep_points(record: dict[str, Any]) -> list[tuple[float, float, str]]:
    """(output tok/s, TTFT p99 ms, point label) per rate (medians over repeats), slowest arrivals first."""
    points = []
    for row in sorted(aggregate(record["runs"]), key=_order):
        ttft = row["ttft_p99_ms"]["median"]
        if ttft is None:
            continue  # no request of this rate produced a token
        points.append((float(row["output_throughput"]["median"]), float(ttft), _point_name(row)))
    return points


def rate_series(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per label (in the order first seen): its ``aggregate`` rows at finite rates without a concurrency limit.

    The runs of every record with one label are pooled, so a server measured in several files makes one line.
    """
    runs: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        runs.setdefault(str(record.get("label")), []).extend(record["runs"])
    series = {}
    for label, pooled in runs.items():
        rows = [r for r in aggregate(pooled) if r["rate"] != "inf" and r["concurrency"] is None]
        series[label] = sorted(rows, key=_order)
    return series


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "minisgl bench plot needs matplotlib: pip install matplotlib (a dependency of minisgl-bench)"
        ) from None
    return plt


def plot_frontier(records: list[tuple[str, dict[str, Any]]], out: Path, title: str | None = None) -> None:
    """Write the PNG ``out``: throughput against TTFT p99, one line per (name, record)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, record in records:
        points = sweep_points(record)
        if not points:
            print(f"{name}: no run with a time to first token; left out", file=sys.stderr)
            continue
        xs, ys, _ = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=record.get("label") or name)
        for x, y, point in points:
            ax.annotate(point, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
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


def _errorbar(ax: Any, rows: list[dict[str, Any]], key: str, **style: Any) -> Any:
    kept = [r for r in rows if r[key]["median"] is not None]
    xs = [float(r["rate"]) for r in kept]
    med = [r[key]["median"] for r in kept]
    below = [r[key]["median"] - r[key]["min"] for r in kept]
    above = [r[key]["max"] - r[key]["median"] for r in kept]
    return ax.errorbar(xs, med, yerr=[below, above], marker="o", capsize=3, **style)


def plot_sweep(
    records: list[dict[str, Any]], out: Path, target_ms: float = 200.0, title: str | None = None
) -> dict[str, dict[str, Any]]:
    """Write the PNG ``out`` (TTFT and throughput against rate); return each label's TTFT p99 crossing."""
    series = rate_series(records)
    crossings = {label: crossing_rate(rows, target_ms) for label, rows in series.items()}
    plt = _pyplot()
    fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, (label, rows) in enumerate(series.items()):
        color = f"C{i}"
        _errorbar(ax_ttft, rows, "ttft_p99_ms", color=color, label=f"{label} p99")
        _errorbar(ax_ttft, rows, "ttft_p50_ms", color=color, linestyle="--", label=f"{label} p50")
        _errorbar(ax_tput, rows, "output_throughput", color=color, label=label)
        if crossings[label]["rate"] is not None:
            ax_ttft.axvline(crossings[label]["rate"], color=color, linestyle=":", alpha=0.6)
    ax_ttft.axhline(target_ms, color="grey", linestyle=":", label=f"{target_ms:g} ms")
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_tput.set_ylabel("output throughput (tok/s)")
    for ax in (ax_ttft, ax_tput):
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return crossings


def plot_timeline(tl: Timeline, out: Path, title: str | None = None) -> None:
    """Write the PNG ``out``: batch size, step time and TTFTs over time, runs shaded."""
    plt = _pyplot()
    fig, (ax_batch, ax_step, ax_ttft) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    ax_batch.step(tl.step_s, tl.batch, where="post", linewidth=0.8, label="requests in the step")
    ax_batch.step(tl.step_s, tl.prefill_reqs, where="post", linewidth=0.8, label="of them prefilling")
    ax_batch.step(tl.step_s, tl.waiting, where="post", linewidth=0.8, label="waiting")
    ax_batch.set_ylabel("requests")
    ax_step.plot(tl.step_s, tl.step_ms, linewidth=0.6, label="step start to next")
    gpu = [(t, g) for t, g in zip(tl.step_s, tl.gpu_ms, strict=True) if g is not None]
    if gpu:
        ax_step.plot(*zip(*gpu, strict=True), linewidth=0.6, label="device time")
    ax_step.set_yscale("log")
    ax_step.set_ylabel("step time (ms)")
    ax_ttft.scatter(tl.request_s, tl.ttft_ms, s=6)
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("TTFT (ms), at arrival")
    ax_ttft.set_xlabel("seconds since the first run began")
    for ax in (ax_batch, ax_step, ax_ttft):
        for begin, end, _ in tl.runs:
            ax.axvspan(begin, end, color="grey", alpha=0.08)
        ax.grid(True, which="both", alpha=0.3)
    for begin, _, name in tl.runs:
        ax_batch.annotate(name, (begin, 1.0), xycoords=("data", "axes fraction"), fontsize=7, va="top")
    for ax in (ax_batch, ax_step):  # beside the axes, clear of the run names along the top
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _trace_of(path: Path, record: dict[str, Any]) -> Path:
    kept = (record.get("launch") or {}).get("trace")
    if not kept:
        raise SystemExit(
            f"{path}: the record names no step trace (bench serve --launch CMD --trace); pass --trace FILE"
        )
    return path.parent / kept


def main(argv: list[str] | None = None) -> int:
    """Run ``minisgl bench plot`` with ``argv`` (default: the command line)."""
    p = argparse.ArgumentParser(prog="minisgl bench plot", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="JSON results of minisgl bench serve")
    p.add_argument("--kind", choices=KINDS, default="frontier", help="what to draw (default: %(default)s)")
    p.add_argument("-o", "--output", type=Path, default=None, help="PNG to write (default: serve-KIND.png)")
    p.add_argument("--trace", type=Path, default=None, help="timeline: the step trace (default: the record's)")
    p.add_argument("--ttft-target-ms", type=float, default=200.0, help="sweep: the TTFT target line")
    p.add_argument("--title", default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    out = args.output or Path(f"serve-{args.kind}.png")
    loaded = [(path, json.loads(path.read_text())) for path in args.files]
    if args.kind == "frontier":
        plot_frontier([(path.stem, record) for path, record in loaded], out, args.title)
    elif args.kind == "sweep":
        crossings = plot_sweep([record for _, record in loaded], out, args.ttft_target_ms, args.title)
        for label, c in crossings.items():
            print(f"{label}: {crossing_line(c)}")
    else:
        if len(loaded) != 1:
            raise SystemExit("minisgl bench plot --kind timeline: pass one result JSON (and its --trace)")
        path, record = loaded[0]
        try:
            _, steps = read_trace(args.trace or _trace_of(path, record))
            tl = timeline(record, steps)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"minisgl bench plot: {exc}") from None
        plot_timeline(tl, out, args.title)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
