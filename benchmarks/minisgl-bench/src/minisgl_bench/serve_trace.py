"""A server's step trace (``minisgl serve --trace-steps FILE``) read beside a ``bench serve`` record.

The trace is JSON Lines: a header (``"trace": "minisgl-steps"``), then one object per
scheduler step (``t`` in unix seconds, ``reqs``, ``prefill_reqs``, ``decode_reqs``,
``running``, ``waiting``, ``gap_ms``, ``gpu_ms``, ...). Unknown keys are ignored, and so is
a last line cut short (a server stopped mid-write); a ``.gz`` file is read as gzip. ``timeline`` puts the steps and the
record's requests on one clock: seconds since the first run began. Nothing here needs
matplotlib.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACE_NAME = "minisgl-steps"


def read_trace(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and the steps of a step trace; raises ValueError naming what is wrong with the file."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            lines = f.read().splitlines()
    else:
        lines = path.read_text().splitlines()
    if not lines:
        raise ValueError(f"{path}: empty; expected a step trace (minisgl serve --trace-steps FILE)")
    try:
        header = json.loads(lines[0])
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("trace") != TRACE_NAME:
        raise ValueError(f"{path}: the first line is not a step trace header ({{'trace': '{TRACE_NAME}', ...}})")
    steps = []
    for n, line in enumerate(lines[1:], start=2):
        try:
            step = json.loads(line)
        except ValueError:
            if n == len(lines):
                break  # cut short when the server was stopped
            raise ValueError(f"{path}, line {n}: not JSON: {line[:100]!r}") from None
        if isinstance(step, dict) and "t" in step:
            steps.append(step)
    return header, steps


@dataclass
class Timeline:
    """Steps and requests on one clock: seconds since ``origin`` (the first run's start, unix seconds)."""

    origin: float
    step_s: list[float] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    """Requests in each step's batch."""
    prefill_reqs: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    """Time from each step's start to the next one's (the last step: its own device or host time)."""
    gpu_ms: list[float | None] = field(default_factory=list)
    request_s: list[float] = field(default_factory=list)
    """Each request's start."""
    ttft_ms: list[float] = field(default_factory=list)
    runs: list[tuple[float, float, str]] = field(default_factory=list)
    """(start, end, name) of each run."""


def _run_name(run: dict[str, Any]) -> str:
    name = "all at once" if run["rate"] == "inf" else f"{run['rate']:g}/s"
    if run.get("concurrency"):
        name += f", c={run['concurrency']}"
    return name + (f" #{run['repeat']}" if run.get("repeat") else "")


def timeline(record: dict[str, Any], steps: list[dict[str, Any]]) -> Timeline:
    """The steps of a trace and the requests of ``record`` (with TTFTs) on the clock of the record's runs.

    Runs need ``start_unix`` (records before it was kept have none, and raise ValueError).
    Steps outside the runs (start-up, warm-up) are kept: they come out at negative times or between runs.
    """
    runs = [r for r in record.get("runs", ()) if r.get("start_unix")]
    if not runs:
        raise ValueError("the record's runs have no start_unix (written by an older minisgl bench serve)")
    tl = Timeline(origin=min(r["start_unix"] for r in runs))
    ordered = sorted(steps, key=lambda s: s["t"])
    for i, step in enumerate(ordered):
        tl.step_s.append(step["t"] - tl.origin)
        tl.batch.append(int(step.get("reqs", 0)))
        tl.prefill_reqs.append(int(step.get("prefill_reqs", 0)))
        tl.waiting.append(int(step.get("waiting", 0)))
        gpu = step.get("gpu_ms")
        tl.gpu_ms.append(float(gpu) if gpu is not None else None)
        if i + 1 < len(ordered):
            tl.step_ms.append((ordered[i + 1]["t"] - step["t"]) * 1000.0)
        else:
            tl.step_ms.append(float(gpu if gpu is not None else step.get("host_ms", 0.0)))
    for run in runs:
        begin = run["start_unix"] - tl.origin
        tl.runs.append((begin, begin + float(run["duration_s"]), _run_name(run)))
        detail = run.get("per_request") or {}
        for start, ttft in zip(detail.get("start_s", ()), detail.get("ttft_ms", ()), strict=True):
            if ttft is not None:
                tl.request_s.append(begin + float(start))
                tl.ttft_ms.append(float(ttft))
    return tl
