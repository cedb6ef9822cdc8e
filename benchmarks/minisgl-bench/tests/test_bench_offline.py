"""``minisgl bench offline``: the workloads are the protocol's, and the record keeps its commit and path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from minisgl_bench.offline import _git_commit, cpu_workload, gpu_workload, warmup_workload, write_record


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
