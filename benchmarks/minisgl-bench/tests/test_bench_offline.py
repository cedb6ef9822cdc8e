"""``minisgl bench offline``: the workloads are the protocol's, and the record keeps its commit and path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from minisgl_bench.offline import _git_commit, cpu_workload, gemm_report, gpu_workload, warmup_workload, write_record


def test_benchmark_workloads_match_the_protocol() -> None:
    gpu = gpu_workload()
    assert len(gpu.prompts) == 256 and gpu.output_tokens == 133_966 and gpu.prompt_tokens == 142_827
    cpu = cpu_workload()
    assert len(cpu.prompts) == 32 and cpu.output_tokens == 2_251


@pytest.mark.parametrize("workload", [cpu_workload, gpu_workload])
def test_benchmark_warmup_shares_no_prefix_with_the_timed_prompts(workload) -> None:
    """A prefix cache must not serve the timed run from the warm-up."""
    work = workload()
    warm = warmup_workload(work)
    assert [len(p) for p in warm.prompts] == [len(p) for p in work.prompts[:8]]
    for w in warm.prompts:
        assert all(w[:4] != p[:4] for p in work.prompts)


def test_commit_comes_from_the_environment_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_COMMIT", "abc1234")
    assert _git_commit() == "abc1234"


def test_write_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_record(tmp_path / "out", "run", {"benchmark": "offline-cpu"})
    assert path == tmp_path / "out" / "run.json"
    assert json.loads(path.read_text()) == {"benchmark": "offline-cpu"}
    assert f"wrote {path}" in capsys.readouterr().out


def test_model_configs_ship_with_the_package() -> None:
    from minisgl_bench.offline import CONFIG_DIR

    assert {p.name for p in CONFIG_DIR.glob("*.json")} >= {"qwen3-0.6b.json", "qwen3-8b.json"}


def test_step_totals_split_the_timed_run_by_step_kind_and_decode_batch(tmp_path: Path) -> None:
    from minisgl_bench.offline import format_step_totals, step_totals

    steps: list[dict[str, object]] = [
        {"t": 5.0, "kind": "prefill", "reqs": 4, "tokens": 999, "host_ms": 9.0, "gpu_ms": 9.0},  # warm-up: left out
        {"t": 10.0, "kind": "prefill", "reqs": 8, "tokens": 800, "host_ms": 1.0, "gpu_ms": 20.0},
        {"t": 10.1, "kind": "mixed", "reqs": 40, "tokens": 300, "host_ms": 0.5, "gpu_ms": 6.0},
        {"t": 10.2, "kind": "decode", "reqs": 40, "tokens": 40, "host_ms": 0.2, "gpu_ms": 3.0},
        {"t": 10.3, "kind": "decode", "reqs": 64, "tokens": 64, "host_ms": 0.2, "gpu_ms": 5.0},
        {"t": 10.4, "kind": "decode", "reqs": 7, "tokens": 7, "host_ms": 0.1, "gpu_ms": None},  # device time unknown
        {"t": 30.0, "kind": "decode", "reqs": 1, "tokens": 1, "host_ms": 0.1, "gpu_ms": 1.0},  # after: left out
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(s) for s in [{"trace": "minisgl-steps", "version": 1}, *steps]) + "\n")
    totals = step_totals(trace, 10.0, 20.0)
    assert totals["kinds"] == {
        "prefill": {"steps": 1, "gpu_ms": 20.0, "host_ms": 1.0, "tokens": 800},
        "mixed": {"steps": 1, "gpu_ms": 6.0, "host_ms": 0.5, "tokens": 300},
        "decode": {"steps": 3, "gpu_ms": 8.0, "host_ms": 0.5, "tokens": 111},
    }
    assert totals["decode_by_batch"] == {
        "32": {"steps": 1, "gpu_ms": 0.0},
        "64": {"steps": 2, "gpu_ms": 8.0},
    }
    table = format_step_totals(totals, 0.05)
    assert "device busy 0.034 s (68%)" in table and "64: 2 steps 4.00 ms" in table


def test_gemm_report_keeps_the_fastest_candidate_per_token_count_and_its_weight_rate() -> None:
    key = "('scaled_mm', 4096, 1024, False)"
    rows = [
        {"key": key, "m": 16, "n": 4096, "k": 1024, "candidate": "a", "ms": 0.004},
        {"key": key, "m": 16, "n": 4096, "k": 1024, "candidate": "b", "ms": 0.002},
        {"key": key, "m": 16, "n": 4096, "k": 1024, "candidate": "c", "skipped": "relative error 1 > 0.08"},
        {"key": key, "m": 32, "n": 4096, "k": 1024, "candidate": "a", "ms": 0.008},
        {"key": "old", "m": 16, "candidate": "a", "ms": 1.0},  # a row without the shape is left out
    ]
    (line,) = gemm_report(rows)
    # 4096 x 1024 bytes in 2 us: 2.10 TB/s; in 8 us: 0.52 TB/s.
    assert line == f"fp8 GEMM {key} [4096 x 1024]: m=16 2.0us 2.10TB/s b, m=32 8.0us 0.52TB/s a"
