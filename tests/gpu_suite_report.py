"""The GPU suite's results per test file, and its report: a table on the terminal, DIR/gpu-suite.md and
DIR/gpu-suite.json (see tests/gpu_suite.py)."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

COLUMNS = ("passed", "failed", "skipped", "errors", "not run")


@dataclass
class FileResult:
    """One test file over all the processes it took."""

    path: str
    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    results: dict[str, list[str]] = field(default_factory=dict)  # test id -> the figures it printed (RESULT lines)
    not_run: int | None = 0  # None: never started
    problems: list[str] = field(default_factory=list)  # failures of the file, not of one test
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    processes: int = 0

    def count(self, column: str) -> int:
        if column == "not run":
            return self.not_run or 0
        outcome = "error" if column == "errors" else column
        return sum(1 for o in self.outcomes.values() if o == outcome) + (
            len(self.problems) if outcome == "error" else 0
        )

    @property
    def ok(self) -> bool:
        return (
            self.not_run == 0
            and not self.problems
            and not any(o in ("failed", "error") for o in self.outcomes.values())
        )

    def to_json(self) -> dict:
        return {
            "file": self.path,
            **{c.replace(" ", "_"): self.count(c) for c in COLUMNS},
            "started": self.not_run is not None,
            "seconds": round(self.seconds, 1),
            "processes": self.processes,
            "ok": self.ok,
            "problems": self.problems,
            "notes": self.notes,
            "failures": [
                {"id": t, "outcome": o, "message": self.messages.get(t, "")}
                for t, o in self.outcomes.items()
                if o in ("failed", "error")
            ],
            "results": self.results,
        }


def totals(results: Sequence[FileResult]) -> dict[str, int]:
    return {c.replace(" ", "_"): sum(r.count(c) for r in results) for c in COLUMNS}


def table(results: Sequence[FileResult], markdown: bool) -> str:
    head = ["file", *COLUMNS, "seconds", "processes"]
    rows = [
        [
            r.path,
            *(str(r.count(c)) if r.not_run is not None else "-" for c in COLUMNS),
            f"{r.seconds:.1f}",
            str(r.processes),
        ]
        for r in results
    ]
    t = totals(results)
    rows.append(
        [
            "total",
            *(str(v) for v in t.values()),
            f"{sum(r.seconds for r in results):.1f}",
            str(sum(r.processes for r in results)),
        ]
    )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*row) for row in [head, *rows])


def failure_lines(results: Sequence[FileResult]) -> list[str]:
    """Markdown lines: each failure, problem and note."""
    lines: list[str] = []
    for r in results:
        for t, o in r.outcomes.items():
            if o in ("failed", "error"):
                first = r.messages.get(t, "").splitlines()[:1]
                lines.append(f"- {o}: `{t}`" + (f": {first[0]}" if first else ""))
        lines += [f"- error in `{r.path}`: {p.splitlines()[0]}" for p in r.problems]
        lines += [f"- `{r.path}`: {n}" for n in r.notes]
    return lines


def machine() -> str:
    try:
        gpus = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            .stdout.strip()
            .splitlines()
        )
    except (OSError, subprocess.SubprocessError):
        gpus = []
    try:
        torch = f"torch {importlib.metadata.version('torch')}"
    except importlib.metadata.PackageNotFoundError:
        torch = "torch not found by its metadata"
    gpu = f"{len(gpus)} x {gpus[0]}" if gpus else "no NVIDIA GPU visible"
    return f"{gpu}; Python {platform.python_version()}, {torch}"


def commit(root: Path) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def write_reports(out: Path, results: Sequence[FileResult], header: dict[str, str], seconds: float, ok: bool) -> None:
    """DIR/gpu-suite.md (for people) and DIR/gpu-suite.json (every failure with its message)."""
    t = totals(results)
    summary = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in t.items() if v) or "no tests"
    md = ["# GPU test suite", ""] + [f"- {k}: {v}" for k, v in header.items()]
    md += [f"- result: **{'passed' if ok else 'FAILED'}**, {summary} in {seconds:.0f} s", "", table(results, True)]
    lines = failure_lines(results)
    if lines:
        md += ["", "## Failures and notes", "", *lines]
    figures = [f"- `{test}`: {line}" for r in results for test, found in r.results.items() for line in found]
    if figures:
        md += ["", "## Figures the tests measured", "", *figures]
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-suite.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    doc = {**header, "ok": ok, "seconds": round(seconds, 1), "totals": t, "files": [r.to_json() for r in results]}
    (out / "gpu-suite.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
