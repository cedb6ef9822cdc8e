"""Figures of ``minisgl bench serve`` beyond one run's latencies: prefix-cache hits, distributions over
repeated runs, where a latency crosses a target, and the tables printed.

A record's ``runs`` hold one entry per run; with ``--repeat N`` each (rate, concurrency)
has N of them. ``aggregate`` groups them and reports, for each figure of ``FIGURES``, the
median, the minimum, the maximum and the values in run order. ``crossing_rate`` finds the
request rate at which a figure's median (TTFT p99 by default) first rises above a
threshold, interpolated linearly between the two measured rates around it. Both work on
records written before ``--repeat`` existed (one run per rate). Nothing here needs
matplotlib.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .serve_client import RequestResult

# figure -> the path to it inside a run's record
FIGURES: dict[str, tuple[str, ...]] = {
    "output_throughput": ("output_throughput",),
    "request_throughput": ("request_throughput",),
    "duration_s": ("duration_s",),
    "ttft_p50_ms": ("ttft_ms", "p50"),
    "ttft_p99_ms": ("ttft_ms", "p99"),
    "tpot_p50_ms": ("tpot_ms", "p50"),
    "tpot_p99_ms": ("tpot_ms", "p99"),
    "itl_p50_ms": ("itl_ms", "p50"),
    "itl_p99_ms": ("itl_ms", "p99"),
    "e2e_p50_ms": ("e2e_ms", "p50"),
    "e2e_p99_ms": ("e2e_ms", "p99"),
    "errors": ("errors",),
    "cache_hit_rate": ("cache_hit_rate",),
}


def figure(run: dict[str, Any], name: str) -> float | None:
    """Figure ``name`` of one run's record (None when the run lacks it, e.g. no request produced a token)."""
    value: Any = run
    for key in FIGURES[name]:
        if not isinstance(value, dict) or value.get(key) is None:
            return None
        value = value[key]
    return float(value)


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, min and max of the known ``values``; ``values`` keeps them all, in order (None where unknown)."""
    known = [v for v in values if v is not None]
    if not known:
        return {"median": None, "min": None, "max": None, "values": list(values)}
    return {"median": statistics.median(known), "min": min(known), "max": max(known), "values": list(values)}


def rate_value(rate: float | str) -> float:
    """A run's rate as a number: ``"inf"`` (all at once) is ``math.inf``."""
    return math.inf if rate == "inf" else float(rate)


def aggregate(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (rate, concurrency), in the order first seen: ``repeats`` and the spread of every figure."""
    groups: dict[tuple[float, int | None], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((rate_value(run["rate"]), run.get("concurrency")), []).append(run)
    rows = []
    for (rate, conc), group in groups.items():
        row: dict[str, Any] = {"rate": "inf" if math.isinf(rate) else rate, "concurrency": conc, "repeats": len(group)}
        for name in FIGURES:
            row[name] = spread([figure(r, name) for r in group])
        rows.append(row)
    return rows


def crossing_rate(
    rows: Sequence[dict[str, Any]], threshold: float = 200.0, name: str = "ttft_p99_ms"
) -> dict[str, Any]:
    """The request rate at which the median of ``name`` first exceeds ``threshold``, from ``aggregate`` rows.

    Only rows at a finite Poisson rate without a concurrency limit count. ``rate`` is interpolated
    linearly between the highest rate still at or under the threshold and the next one measured, which
    is over it; it is None when no two such rates bracket the crossing, and ``note`` says why.
    """
    points = sorted(
        (float(r["rate"]), r[name]["median"])
        for r in rows
        if r["rate"] != "inf" and r.get("concurrency") is None and r[name]["median"] is not None
    )
    out: dict[str, Any] = {"figure": name, "threshold": threshold, "rate": None}
    if not points:
        return {**out, "note": "no run at a finite rate"}
    if points[0][1] > threshold:
        return {**out, "note": f"over {threshold:g} already at the lowest rate, {points[0][0]:g}/s"}
    for (r0, y0), (r1, y1) in zip(points, points[1:], strict=False):
        if y0 <= threshold < y1:
            rate = r0 + (threshold - y0) * (r1 - r0) / (y1 - y0)
            return {**out, "rate": rate, "note": f"between {r0:g}/s ({y0:.1f}) and {r1:g}/s ({y1:.1f})"}
    return {**out, "note": f"never over {threshold:g} up to {points[-1][0]:g}/s"}


def _hit_rate(pairs: Sequence[tuple[int, int]]) -> float | None:
    """sum(cached) / sum(prompt) over (cached, prompt) pairs; None without any prompt token."""
    prompt = sum(p for _, p in pairs)
    return sum(c for c, _ in pairs) / prompt if prompt else None


def cache_figures(ok: Sequence[RequestResult]) -> dict[str, Any]:
    """Prefix-cache hits reported by the server: ``usage.prompt_tokens_details.cached_tokens``.

    The hit rate is sum(cached_tokens) / sum(prompt_tokens) over the requests whose usage has both;
    it is also given for first turns and for follow-ups (later turns, which repeat their conversation
    so far) apart, since routing that keeps a conversation on one replica shows in the latter.
    """
    pairs = [(r, (r.usage_cached_tokens, r.usage_input_tokens)) for r in ok]
    known = [(r, (c, p)) for r, (c, p) in pairs if c is not None and p is not None]
    return {
        "requests_with_cached_tokens": len(known),
        "cached_tokens": sum(c for _, (c, _) in known),
        "cache_hit_rate": _hit_rate([cp for _, cp in known]),
        "cache_hit_rate_first_turns": _hit_rate([cp for r, cp in known if r.turn == 0]),
        "cache_hit_rate_follow_ups": _hit_rate([cp for r, cp in known if r.turn > 0]),
    }


def _fmt(stats: dict[str, float | None], key: str) -> str:
    v = stats[key]
    return "-" if v is None else f"{v:.1f}"


HEADER = (
    f"{'rate':>6} {'conc':>5} {'rep':>3} {'ok':>5} {'err':>4} {'dur s':>7} {'req/s':>6} {'out tok/s':>10}"
    f" {'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} {'E2E p50/p99 ms':>17} {'hit %':>6}"
)
"""The table of runs that ``bench serve`` prints: one ``run_row`` per run."""


def run_row(r: dict[str, Any]) -> str:
    """One run's line of the table under ``HEADER``."""

    def pair(name: str, width: int) -> str:
        return f"{_fmt(r[name], 'p50') + ' / ' + _fmt(r[name], 'p99'):>{width}}"

    return (
        f"{r['rate']!s:>6} {r['concurrency'] or '-'!s:>5} {r['repeat']:>3} {r['completed']:>5} {r['errors']:>4}"
        f" {r['duration_s']:>7.2f} {r['request_throughput']:>6.2f} {r['output_throughput']:>10.1f}"
        f" {pair('ttft_ms', 17)} {pair('tpot_ms', 16)} {pair('itl_ms', 15)} {pair('e2e_ms', 17)}"
        f" {'-' if r.get('cache_hit_rate') is None else format(100 * r['cache_hit_rate'], '.1f'):>6}"
    )


def crossing_line(crossing: dict[str, Any]) -> str:
    """``crossing_rate``'s answer in words."""
    if crossing["rate"] is None:
        return f"TTFT p99 against {crossing['threshold']:g} ms: {crossing['note']}"
    return f"TTFT p99 crosses {crossing['threshold']:g} ms at {crossing['rate']:.2f} req/s ({crossing['note']})"


def _spread_cell(s: dict[str, Any], digits: int = 1, scale: float = 1.0) -> str:
    if s["median"] is None:
        return "-"
    m, lo, hi = (s[k] * scale for k in ("median", "min", "max"))
    return f"{m:.{digits}f}" if lo == hi else f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def summary_table(rows: list[dict[str, Any]], crossing: dict[str, Any]) -> str:
    """Median [min-max] over repeats of the headline figures, one line per rate, and the TTFT p99 crossing."""
    cols = [
        ("out tok/s", "output_throughput", 0, 1.0),
        ("TTFT p50 ms", "ttft_p50_ms", 1, 1.0),
        ("TTFT p99 ms", "ttft_p99_ms", 1, 1.0),
        ("TPOT p50 ms", "tpot_p50_ms", 2, 1.0),
        ("cache hit %", "cache_hit_rate", 1, 100.0),
    ]
    lines = ["", "median [min-max] over repeats:"]
    cells = [[str(r["rate"]), str(r["concurrency"] or "-"), str(r["repeats"])] for r in rows]
    for cell, r in zip(cells, rows, strict=True):
        cell += [_spread_cell(r[key], digits, scale) for _, key, digits, scale in cols]
    head = ["rate", "conc", "n", *(name for name, *_ in cols)]
    widths = [max(len(h), *(len(c[j]) for c in cells)) for j, h in enumerate(head)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
    lines.append(crossing_line(crossing))
    return "\n".join(lines)
