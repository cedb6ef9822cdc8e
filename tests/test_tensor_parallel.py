"""Tensor parallelism on CPU (gloo): tp=2 gives the same tokens as tp=1."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.testing.models import random_prompts, save_tiny_model

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LENGTHS = [5, 40, 130, 17]


def _generate(path: Path, **kwargs) -> list[list[int]]:  # type: ignore[no-untyped-def]
    prompts = random_prompts(LENGTHS, 512, seed=11)
    with LLM(str(path), page_size=4, chunked_prefill_size=64, **kwargs) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        seeded = llm.generate(prompts[:2], SamplingParams(temperature=1.0, seed=5, max_tokens=8), use_tqdm=False)
        llm.check_accounting()
        assert llm.kv_pages_in_use == 0
    return outs + [o.token_ids for o in seeded]


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("LlamaForCausalLM", {}),
        ("Qwen2ForCausalLM", {}),  # q/k/v bias, tied embeddings
        ("Qwen3ForCausalLM", {"num_key_value_heads": 1}),  # fewer KV heads than ranks: replicated
    ],
    ids=["llama", "qwen2-tied", "qwen3-one-kv-head"],
)
def test_tp2_equals_tp1(tmp_path: Path, arch: str, overrides: dict) -> None:
    save_tiny_model(arch, tmp_path, **overrides)
    assert _generate(tmp_path, tp=2) == _generate(tmp_path)


def test_tp2_qwen3_moe_equals_tp1(tmp_path: Path) -> None:
    pytest.importorskip("minisgl_plugin_qwen3_moe")
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    )
    save_tiny_model("Qwen3MoeForCausalLM", tmp_path, config=config)
    assert _generate(tmp_path, tp=2) == _generate(tmp_path)


def test_indivisible_heads_are_a_clear_error(tmp_path: Path) -> None:
    save_tiny_model("LlamaForCausalLM", tmp_path, num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(
        ValueError, match=r"number of attention heads \(4\) is not divisible by the tensor-parallel size 3"
    ):
        LLM(str(tmp_path), tp=3)
    _assert_no_rank_processes()


def test_killed_rank_fails_fast_and_leaves_no_process(tmp_path: Path) -> None:
    save_tiny_model("LlamaForCausalLM", tmp_path)
    llm = LLM(str(tmp_path), tp=2)
    try:
        (proc,) = llm._ranks.procs
        assert _rank_children() == [proc.pid]  # what _assert_no_rank_processes looks for
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank1 exited"):
            llm.generate(random_prompts([8], 512), PARAMS, use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        llm._ranks.kill()
    _assert_no_rank_processes()


def _rank_children() -> list[int]:
    """Live rank processes (``python -m minisgl.scheduler.tp_rank``) started by this process."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"minisgl.scheduler.tp_rank" in cmdline:
            out.append(int(entry.name))
    return out


def _assert_no_rank_processes() -> None:
    deadline = time.monotonic() + 10
    while _rank_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _rank_children() == []


def test_two_nodes_on_loopback_equal_tp1(tmp_path: Path) -> None:
    """--nnodes 2, one rank each: node 1 runs in its own process, started like a second machine would."""
    import subprocess
    import sys

    from minisgl.distributed.group import free_port

    save_tiny_model("LlamaForCausalLM", tmp_path)
    addr = f"127.0.0.1:{free_port()}"
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from minisgl.config import EngineConfig; from minisgl.scheduler.tp import run_follower_node; "
            f"sys.exit(run_follower_node(EngineConfig(model={str(tmp_path)!r}, page_size=4, chunked_prefill_size=64, "
            f"tp=2, nnodes=2, node_rank=1, dist_init_addr={addr!r})))",
        ]
    )
    try:
        two_nodes = _generate(tmp_path, tp=2, nnodes=2, node_rank=0, dist_init_addr=addr)
        assert node1.wait(timeout=60) == 0
    finally:
        node1.kill()
    assert two_nodes == _generate(tmp_path)
