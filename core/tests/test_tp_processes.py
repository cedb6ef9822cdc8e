"""Tensor-parallel rank processes: started from a plain script, and watched while the group forms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.scheduler.tp import TensorParallelError
from minisgl.testing.models import save_tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Each rank loads the architecture by plugin name, so it must come from an installed plugin.
    pytest.importorskip("minisgl_plugin_llama")
    path = tmp_path_factory.mktemp("tp-llama")
    save_tiny_model("LlamaForCausalLM", path)
    return path


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_tp2_from_a_script_without_a_main_guard(llama_dir: Path, tmp_path: Path) -> None:
    """The usual first script: no ``if __name__ == "__main__":``, no close(). It finishes with tp=1's tokens."""
    script = tmp_path / "generate.py"
    script.write_text(
        "import json\n"
        "from minisgl import LLM, SamplingParams\n"
        f"llm = LLM({str(llama_dir)!r}, tp=2, device='cpu', page_size=4)\n"
        f"outs = llm.generate({PROMPTS!r}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), "
        "use_tqdm=False)\n"
        "print('PIDS', json.dumps([p.pid for p in llm._ranks.procs]))\n"
        "print('TOKENS', json.dumps([o.token_ids for o in outs]))\n"
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert time.monotonic() - start < 90, "the group took minutes to form"
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("PIDS", "TOKENS")))
    with LLM(str(llama_dir), device="cpu", page_size=4) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert json.loads(lines["TOKENS"]) == expected
    # The rank the script started does not outlive it.
    (rank1,) = json.loads(lines["PIDS"])
    deadline = time.monotonic() + 10
    while _alive(rank1) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(rank1)


def test_a_rank_that_dies_before_joining_fails_within_seconds(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every new interpreter (only the rank: this one is running already) exits at start-up.
    (tmp_path / "sitecustomize.py").write_text("raise SystemExit(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    with pytest.raises(
        TensorParallelError, match=r"minisgl-tp-rank1 \(pid \d+\) exited with code \d+ before joining the group"
    ):
        LLM(str(llama_dir), tp=2, device="cpu", page_size=4)
    assert time.monotonic() - start < 30


def test_grammar_compiles_and_late_masks_are_decided_by_rank_0(tmp_path: Path) -> None:
    """A grammar compiling while others decode, and a mask that rank 0 finds late: every rank queues and ends the
    same requests at the same step, so tp=2 gives tp=1's tokens and finish reasons."""
    pytest.importorskip("minisgl_plugin_llama")
    from minisgl.testing.models import save_word_tokenizer

    model = tmp_path / "m"
    hf_model = save_tiny_model("LlamaForCausalLM", model)
    save_word_tokenizer(model, hf_model.config.vocab_size)
    plugin = Path(__file__).with_name("grammar_script_plugin.py")
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [11, 12, 13]]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, grammar=("regex", "sleep:0.5")),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, grammar=("regex", "late:3")),
    ]
    runs = []
    for tp in (1, 2):
        kwargs = {"tp": tp, "device": "cpu", "page_size": 4, "plugin_paths": str(plugin), "grammar_mask_timeout": 0.05}
        with LLM(str(model), **kwargs) as llm:  # type: ignore[arg-type]
            outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.token_ids, o.finish_reason) for o in outs])
    assert runs[1] == runs[0]
    assert [reason for _, reason in runs[0]] == ["length", "length", "grammar_error"]
    assert len(runs[0][2][0]) == 3 and set(runs[0][1][0]) <= set(range(3, 10))
