"""Qwen3-MoE against transformers, token for token (float32, CPU), and checkpoint handling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from minisgl import LLM, SamplingParams
from minisgl.core import Batch
from minisgl.layers import GatedMLP
from minisgl.moe import SparseMoEBlock
from minisgl.testing.models import hf_greedy, random_prompts, save_tiny_model

LENGTHS = [5, 17, 120, 40, 9, 33]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def references(tiny_moe) -> dict[str, list[list[int]]]:
    _, model = tiny_moe
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=1)
    return {"prompts": prompts, "outputs": hf_greedy(model, prompts, NEW_TOKENS)}


@pytest.mark.parametrize(("page_size", "chunk"), [(1, 512), (16, 512), (16, 50)], ids=["page1", "page16", "chunked"])
def test_greedy_matches_transformers(tiny_moe, references, page_size: int, chunk: int) -> None:
    path, _ = tiny_moe
    with LLM(str(path), page_size=page_size, chunked_prefill_size=chunk, max_running_requests=8) as llm:
        assert llm.engine.config.moe_backend == "auto"
        assert type(llm.engine.moe_backend).__name__ == "TorchMoEBackend"  # auto on CPU
        outs = llm.generate(
            references["prompts"], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        )
        assert [o.token_ids for o in outs] == references["outputs"]
        llm.check_accounting()
        assert llm.kv_pages_in_use == 0


def prefill_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    sched = llm.scheduler
    reqs = [sched.add_request(p, SamplingParams(max_tokens=1)) for p in prompts]
    for r in reqs:
        assert sched.kv.try_admit(r)
        r.device_len = r.prompt_len
    batch = Batch(reqs, "prefill", sample_mask=[True] * len(reqs))
    return llm.engine.prefill_logits(batch, sched._prepare(batch))


def hf_logits(model: Any, prompts: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(torch.tensor([p])).logits[0] for p in prompts])


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_logits_match_transformers(tiny_moe, page_size: int) -> None:
    path, model = tiny_moe
    prompts = random_prompts([7, 40, 129], model.config.vocab_size, seed=3)
    with LLM(str(path), page_size=page_size) as llm:
        got = prefill_logits(llm, prompts)
    ref = hf_logits(model, prompts)
    assert (got - ref).abs().max().item() < 1e-4


def test_layers_follow_mlp_only_layers_and_sparse_step(moe_config, tmp_path: Path) -> None:
    cfg = moe_config(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    model = save_tiny_model("Qwen3MoeForCausalLM", tmp_path, config=cfg)
    hf_sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers]
    assert hf_sparse == [False, True, False, False]
    with LLM(str(tmp_path)) as llm:
        layers = llm.engine.model.model.layers
        assert [isinstance(layer.mlp, SparseMoEBlock) for layer in layers] == hf_sparse
        assert all(isinstance(layer.mlp, GatedMLP) for layer, s in zip(layers, hf_sparse, strict=True) if not s)
        prompts = random_prompts([12, 30], cfg.vocab_size, seed=5)
        assert (prefill_logits(llm, prompts) - hf_logits(model, prompts)).abs().max().item() < 1e-4


def test_without_topk_renormalisation(moe_config, tmp_path: Path) -> None:
    cfg = moe_config(norm_topk_prob=False, num_experts_per_tok=3)
    model = save_tiny_model("Qwen3MoeForCausalLM", tmp_path, config=cfg, seed=2)
    prompts = random_prompts([20, 9], cfg.vocab_size, seed=6)
    with LLM(str(tmp_path)) as llm:
        assert (prefill_logits(llm, prompts) - hf_logits(model, prompts)).abs().max().item() < 1e-4


def fused_copy(src: Path, dst: Path) -> None:
    """The same model with experts stored fused: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if ".experts." not in name:
            out[name] = t
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in state:
            continue
        n = sum(1 for name in state if name.startswith(f"{prefix}.") and name.endswith(".gate_proj.weight"))
        gate = torch.stack([state[f"{prefix}.{e}.gate_proj.weight"] for e in range(n)])
        up = torch.stack([state[f"{prefix}.{e}.up_proj.weight"] for e in range(n)])
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
        out[f"{prefix}.down_proj"] = torch.stack([state[f"{prefix}.{e}.down_proj.weight"] for e in range(n)])
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_fused_expert_layout_loads_the_same_model(tiny_moe, tmp_path: Path) -> None:
    path, model = tiny_moe
    fused = tmp_path / "fused"
    fused_copy(path, fused)
    names = load_file(str(fused / "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names)
    prompts = random_prompts([11, 25], model.config.vocab_size, seed=4)
    with LLM(str(path)) as a, LLM(str(fused)) as b:
        assert torch.equal(prefill_logits(a, prompts), prefill_logits(b, prompts))


def test_missing_expert_is_an_error(tiny_moe, tmp_path: Path) -> None:
    path, _ = tiny_moe
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"missing weights for model.layers.2.mlp.experts: expert 5 up_proj"):
        LLM(str(broken))
