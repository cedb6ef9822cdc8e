"""``minisgl bench steps``: a step trace split by run, per step kind, with the mixed steps' cost fitted."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from minisgl_bench.cli import main as bench_main
from minisgl_bench.steps_report import report, summarize_steps


def _trace(path: Path, steps: list[dict[str, object]]) -> Path:
    lines = [json.dumps({"trace": "minisgl-steps", "version": 1})] + [json.dumps(s) for s in steps]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _steps() -> list[dict[str, object]]:
    """Decodes of 2 ms, and a mixed step every tenth costing 10 ms + 1 us per prefill token."""
    out: list[dict[str, object]] = []
    t = 100.0
    for i in range(200):
        if i % 10 == 5:
            tokens = 100 * (i % 7 + 1)
            ms = 10.0 + tokens / 1000.0
            out.append({"t": t, "kind": "mixed", "prefill_tokens": tokens, "host_ms": ms, "gpu_ms": ms, "running": 8})
        else:
            ms = 2.0
            out.append({"t": t, "kind": "decode", "prefill_tokens": 0, "host_ms": ms, "gpu_ms": ms, "running": 8})
        out[-1]["events"] = ["gc:gen0:1.0ms"] if i == 7 else []
        t += ms / 1000.0
    return out


def test_the_mixed_steps_cost_is_split_into_fixed_and_per_token() -> None:
    summary = summarize_steps(_steps())
    mixed, decode = summary["mixed"], summary["decode"]
    assert mixed["steps"] == 20 and decode["steps"] == 180
    assert abs(mixed["fit"]["fixed_ms"] - 10.0) < 1e-6 and abs(mixed["fit"]["us_per_prefill_token"] - 1.0) < 1e-6
    share = sum(10.0 + 100 * (i % 7 + 1) / 1000.0 for i in range(5, 200, 10)) / (20 * 10.0 + 2.0 * 180 + 0.0)
    assert abs(mixed["host_share"] - share) < 0.01
    assert decode["host_ms"]["p50"] == 2.0 and summary["events"] == {"gc": 1}
    assert summary["gc_ms"] == {"total": 1.0, "max": 1.0}


def test_a_record_splits_the_trace_by_run_and_the_cli_prints_and_saves(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    steps = _steps()
    trace = _trace(tmp_path / "t.jsonl.gz", steps)
    record = {
        "runs": [
            {"rate": "inf", "repeat": 0, "start_unix": 100.0, "duration_s": 0.1},
            {"rate": 8.0, "repeat": 0, "start_unix": 100.1, "duration_s": 10.0},
        ]
    }
    rows = report(steps, record)
    assert [name for name, _ in rows] == ["all at once", "8/s"]
    assert sum(s["steps"] for _, s in rows) == len(steps)
    (tmp_path / "r.json").write_text(json.dumps(record))
    out = tmp_path / "steps.json"
    assert bench_main(["steps", str(trace), "--record", str(tmp_path / "r.json"), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "8/s:" in printed and "mixed" in printed and "us/token" in printed
    assert set(json.loads(out.read_text())) == {"all at once", "8/s"}


def test_a_file_that_is_not_a_trace_is_named(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"not": "a trace"}\n')
    assert bench_main(["steps", str(bad)]) == 2
    assert "not a step trace header" in capsys.readouterr().err


def test_the_token_gap_counts_each_interval_once_per_decoding_request() -> None:
    # Nine 2 ms steps decoding one request each, then one 50 ms step followed by a step decoding 99 requests:
    # by step the long interval is one in ten (p50 2 ms), by token it is what 99 of 108 tokens waited.
    t, steps = 0.0, []
    for ms, decoding in [(2.0, 1)] * 9 + [(50.0, 1), (2.0, 99)]:
        steps.append({"t": t, "kind": "decode", "decode_reqs": decoding, "host_ms": ms, "gpu_ms": ms})
        t += ms / 1000.0
    summary = summarize_steps(steps)
    assert abs(summary["interval_ms"]["p50"] - 2.0) < 1e-6
    gap = summary["token_gap_ms"]
    assert gap["tokens"] == 9 + 99 and abs(gap["p50"] - 50.0) < 1e-6 and abs(gap["p99"] - 50.0) < 1e-6
    assert summarize_steps(steps[:1])["token_gap_ms"] == {"p50": None, "p99": None, "tokens": 0}
