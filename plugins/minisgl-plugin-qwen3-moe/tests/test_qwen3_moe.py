"""Qwen3-MoE against transformers (the model conformance kit, float32, CPU), layer layout and checkpoint handling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from minisgl import LLM
from minisgl.layers import GatedMLP
from minisgl.moe import SparseMoEBlock
from minisgl.testing.model_conformance import ModelConformance, prefill_logits
from minisgl.testing.models import random_prompts, save_tiny_model


class TestQwen3MoE(ModelConformance):
    """The model conformance kit (docs/plugin-testing.md): greedy tokens and logprobs against transformers."""

    architecture = "Qwen3MoeForCausalLM"
    provider = "qwen3_moe"
    # 8 experts, top-2, 3 layers of which layer 1 is dense (the conftest's tiny_moe_config).
    config_overrides: dict[str, Any] = {
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    }


def test_auto_moe_backend_is_torch_on_cpu(tiny_moe) -> None:
    path, _ = tiny_moe
    with LLM(str(path), max_running_requests=2) as llm:
        assert llm.engine.config.moe_backend == "auto"
        assert type(llm.engine.moe_backend).__name__ == "TorchMoEBackend"


def hf_logits(model: Any, prompts: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(torch.tensor([p])).logits[0] for p in prompts])


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
