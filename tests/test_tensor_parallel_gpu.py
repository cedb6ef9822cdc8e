"""Tensor parallelism on two CUDA GPUs (NCCL): tp=2 agrees with tp=1 in bfloat16.

Runs only where at least two GPUs are visible; results of the H200 run are in
docs/benchmarks/tp_h200x2.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.testing.models import random_prompts, save_tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def _teacher_forced(path: Path, reference: list[list[int]], prompts: list[list[int]], **kwargs) -> list[int]:  # type: ignore[no-untyped-def]
    """The greedy next token after every prefix ``prompt + reference[:k]`` (one prefill each)."""
    inputs = [p + ref[:k] for p, ref in zip(prompts, reference) for k in range(len(ref))]
    with LLM(str(path), device="cuda", dtype="bfloat16", **kwargs) as llm:
        outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        llm.check_accounting()
    return [o.token_ids[0] for o in outs]


@pytest.mark.parametrize("graphs", [0, 64], ids=["eager", "cuda-graphs"])
def test_tp2_agrees_with_tp1_bf16(tmp_path: Path, graphs: int) -> None:
    save_tiny_model(
        "Qwen3ForCausalLM",
        tmp_path,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=4,
    )
    prompts = random_prompts([9, 40, 130, 300, 17, 64, 5, 200], 512, seed=21)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(str(tmp_path), device="cuda", dtype="bfloat16", cuda_graph_max_bs=graphs) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(tmp_path), device="cuda", dtype="bfloat16", cuda_graph_max_bs=graphs, tp=2) as llm:
        free = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.check_accounting()
    free_running = sum(a == b for x, y in zip(ref, free) for a, b in zip(x, y)) / sum(len(x) for x in ref)
    # Both sizes score the same positions through the same (prefill) kernels: only TP differs.
    one = _teacher_forced(tmp_path, ref, prompts, cuda_graph_max_bs=graphs)
    two = _teacher_forced(tmp_path, ref, prompts, cuda_graph_max_bs=graphs, tp=2)
    forced = sum(a == b for a, b in zip(one, two)) / len(one)
    print(f"RESULT graphs={graphs} free-running={free_running:.4f} teacher-forced={forced:.4f}")
    assert forced >= 0.99
