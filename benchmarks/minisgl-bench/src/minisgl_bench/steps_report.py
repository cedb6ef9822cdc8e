"""``minisgl bench steps TRACE [--record RECORD]``: where a server's step time went, per run.

Reads a step trace (``minisgl serve --trace-steps FILE``; ``.gz`` too) and, given the ``bench serve`` record
of the same server, splits the steps by run (each run's ``start_unix`` and ``duration_s``). Per run and step
kind (decode, mixed, prefill): how many, their share of the host time, host and device time (median and p99),
prefill tokens, running requests, and for mixed steps a least-squares fit ``device ms = fixed + per token x
prefill tokens``, which tells a step's fixed cost (launches, planning) from its work. Also the step interval,
the token gap (the server-side inter-token latency: each step's interval counted once for every request that
decodes a token in it, which is what a stream waits between two of its tokens, whatever the client's chunking)
and the stall events. ``--json`` writes the same numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from .serve_trace import _run_name, read_trace

KINDS = ("decode", "mixed", "prefill")


def _pct(values: list[float], p: float) -> float | None:
    """The ``p`` quantile (0-1) as ``bench serve`` computes its percentiles (numpy's, interpolated)."""
    return float(np.percentile(values, p * 100.0)) if values else None


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """``(intercept, slope)`` of the least-squares line through the points (None: too few, or one x)."""
    if len(xs) < 3 or len(set(xs)) < 2:
        return None
    slope, intercept = np.polyfit(xs, ys, 1)
    return float(intercept), float(slope)


def _weighted_pct(values: list[float], weights: list[float], p: float) -> float | None:
    """The ``p`` quantile (0-1) of ``values`` where each counts ``weights`` times (the lower value at a tie)."""
    total = float(sum(weights))
    if not values or total <= 0:
        return None
    order = np.argsort(values)
    cum = np.cumsum(np.asarray(weights, dtype=float)[order])
    return float(np.asarray(values, dtype=float)[order][min(int(np.searchsorted(cum, p * total)), len(values) - 1)])


def _event_ms(event: str) -> float:
    """The duration an event such as ``gc:gen1:41.0ms`` ends with (0 when it names none)."""
    tail = event.rsplit(":", 1)[-1]
    try:
        return float(tail[:-2]) if tail.endswith("ms") else 0.0
    except ValueError:
        return 0.0


def summarize_steps(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers above for one window of steps (ordered by time)."""
    steps = sorted(steps, key=lambda s: s["t"])
    host_total = sum(float(s.get("host_ms", 0.0)) for s in steps) or 1.0
    out: dict[str, Any] = {"steps": len(steps)}
    interval = [(b["t"] - a["t"]) * 1000.0 for a, b in zip(steps, steps[1:], strict=False)]
    out["interval_ms"] = {"p50": _pct(interval, 0.5), "p99": _pct(interval, 0.99), "max": max(interval, default=None)}
    # A request decoding in step b got its previous token from the step before: it waited b's interval.
    weights = [float(b.get("decode_reqs", 0)) for b in steps[1:]]
    out["token_gap_ms"] = {
        "p50": _weighted_pct(interval, weights, 0.5),
        "p99": _weighted_pct(interval, weights, 0.99),
        "tokens": int(sum(weights)),
    }
    out["events"] = dict(Counter(e.split(":", 1)[0] for s in steps for e in s.get("events", ())))
    gc_ms = [_event_ms(e) for s in steps for e in s.get("events", ()) if e.startswith("gc:")]
    out["gc_ms"] = {"total": sum(gc_ms), "max": max(gc_ms, default=None)}
    for kind in KINDS:
        group = [s for s in steps if s.get("kind") == kind]
        if not group:
            continue
        host = [float(s.get("host_ms", 0.0)) for s in group]
        gpu = [float(s["gpu_ms"]) for s in group if s.get("gpu_ms") is not None]
        prefill = [float(s.get("prefill_tokens", 0)) for s in group]
        entry: dict[str, Any] = {
            "steps": len(group),
            "host_share": sum(host) / host_total,
            "host_ms": {"p50": _pct(host, 0.5), "p99": _pct(host, 0.99)},
            "gpu_ms": {"p50": _pct(gpu, 0.5), "p99": _pct(gpu, 0.99)},
            "prefill_tokens": {"p50": _pct(prefill, 0.5), "p99": _pct(prefill, 0.99)},
            "running_p50": _pct([float(s.get("running", 0)) for s in group], 0.5),
        }
        if kind == "mixed":
            timed = [s for s in group if s.get("gpu_ms") is not None]
            ys = [float(s["gpu_ms"]) for s in timed] if timed else host
            xs = [float(s.get("prefill_tokens", 0)) for s in timed] if timed else prefill
            fit = _fit(xs, ys)
            if fit is not None:
                entry["fit"] = {"fixed_ms": fit[0], "us_per_prefill_token": fit[1] * 1000.0}
        out[kind] = entry
    return out


def run_steps(steps: list[dict[str, Any]], run: dict[str, Any]) -> list[dict[str, Any]]:
    """The steps that began during ``run`` (a ``bench serve`` run with ``start_unix`` and ``duration_s``)."""
    begin = float(run["start_unix"])
    end = begin + float(run["duration_s"])
    return [s for s in steps if begin <= s["t"] <= end]


def report(steps: list[dict[str, Any]], record: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """``(name, summary)`` per run of ``record`` (all the steps as one window without a record)."""
    if record is None:
        return [("all steps", summarize_steps(steps))]
    out = []
    for run in record.get("runs", ()):
        if not run.get("start_unix"):
            continue
        out.append((_run_name(run), summarize_steps(run_steps(steps, run))))
    if not out:
        raise ValueError("the record's runs have no start_unix (written by an older minisgl bench serve)")
    return out


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_report(rows: list[tuple[str, dict[str, Any]]]) -> str:
    lines = []
    for name, summary in rows:
        iv, gap = summary["interval_ms"], summary["token_gap_ms"]
        lines.append(
            f"{name}: {summary['steps']} steps; interval p50 {_fmt(iv['p50'])} p99 {_fmt(iv['p99'])} "
            f"max {_fmt(iv['max'], 1)} ms; token gap p50 {_fmt(gap['p50'])} p99 {_fmt(gap['p99'])} ms; "
            f"events {summary['events'] or '-'}"
        )
        if summary["gc_ms"]["max"] is not None:
            lines[-1] += (
                f"; collections {summary['gc_ms']['total']:.1f} ms in all, longest {summary['gc_ms']['max']:.1f}"
            )
        for kind in KINDS:
            e = summary.get(kind)
            if e is None:
                continue
            line = (
                f"  {kind:<7} {e['steps']:>6} steps, {e['host_share']:>4.0%} of host time; host p50/p99 "
                f"{_fmt(e['host_ms']['p50'])}/{_fmt(e['host_ms']['p99'])} ms, device "
                f"{_fmt(e['gpu_ms']['p50'])}/{_fmt(e['gpu_ms']['p99'])} ms; prefill tokens p50/p99 "
                f"{_fmt(e['prefill_tokens']['p50'], 0)}/{_fmt(e['prefill_tokens']['p99'], 0)}; running p50 "
                f"{_fmt(e['running_p50'], 0)}"
            )
            if "fit" in e:
                line += f"; fit {e['fit']['fixed_ms']:.2f} ms + {e['fit']['us_per_prefill_token']:.2f} us/token"
            lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minisgl bench steps", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="a step trace (minisgl serve --trace-steps FILE), .gz allowed")
    p.add_argument("--record", type=Path, help="the bench serve JSON of the same server: split by run")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    args = p.parse_args(argv)
    try:
        _, steps = read_trace(args.trace)
        record = json.loads(args.record.read_text()) if args.record else None
        rows = report(steps, record)
    except (OSError, ValueError) as exc:
        print(f"minisgl bench steps: {exc}", file=sys.stderr)
        return 2
    print(format_report(rows))
    if args.json:
        args.json.write_text(json.dumps({name: summary for name, summary in rows}, indent=1) + "\n")
    return 0
