"""Distributions over repeated runs of ``minisgl bench serve``, and where a latency crosses a target.

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
from typing import Any

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
