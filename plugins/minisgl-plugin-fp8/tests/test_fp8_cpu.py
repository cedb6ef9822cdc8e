"""FP8 checkpoints on the CPU: each layout, written as the Hugging Face and compressed-tensors tools write it,
generates greedily the tokens transformers generates from the de-quantized weights (float32); ``--quantization
fp8`` quantizes a float checkpoint at load; unsupported settings are refused by name, leaving nothing behind."""

from __future__ import annotations

import copy
import gc
import json
import re
import threading
from pathlib import Path

import pytest
import torch
from minisgl_plugin_fp8.reference import dequantize, quantize_rows
from minisgl_plugin_fp8.testing import LAYOUTS, write_fp8_checkpoint

from minisgl import LLM, SamplingParams
from minisgl.core import ValidationError
from minisgl.testing.models import hf_greedy, random_prompts, save_tiny_model

PROMPTS = random_prompts([5, 17, 33], vocab_size=512, seed=3)
MAX_TOKENS = 12
# Shapes that are not multiples of 128 (192, 320: partial scale blocks) and ones that are (256, 512).
SHAPES = {
    "odd": {"hidden_size": 192, "intermediate_size": 320, "num_attention_heads": 6, "head_dim": 32},
    "even": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "head_dim": 64},
}
ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def float_models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, object]]:
    models = {}
    for arch in ARCHS:
        for shape, fields in SHAPES.items():
            path = tmp_path_factory.mktemp(f"{arch}-{shape}")
            models[arch, shape] = path, save_tiny_model(arch, path, **fields)
    return models


def reference_tokens(hf_model: object, state: dict[str, torch.Tensor]) -> list[list[int]]:
    model = copy.deepcopy(hf_model)
    model.load_state_dict(state)  # type: ignore[attr-defined]
    return hf_greedy(model, PROMPTS, MAX_TOKENS)


def generate(path: Path, **kwargs: object) -> list[list[int]]:
    with LLM(str(path), device="cpu", **kwargs) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        llm.check_accounting()
        assert llm.kv_pages_in_use == 0
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint_matches_transformers_on_dequantized_weights(
    float_models: dict, tmp_path: Path, layout: str, arch: str, shape: str
) -> None:
    source, hf_model = float_models[arch, shape]
    state = write_fp8_checkpoint(source, tmp_path, layout)
    assert generate(tmp_path) == reference_tokens(hf_model, state)


@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel"])
def test_modules_left_unquantized_load_as_float(float_models: dict, tmp_path: Path, layout: str) -> None:
    source, hf_model = float_models["LlamaForCausalLM", "odd"]
    ignore = ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj"]
    state = write_fp8_checkpoint(source, tmp_path, layout, ignore=ignore)
    with LLM(str(tmp_path), device="cpu") as llm:
        layers = llm.engine.model.model.layers
        assert "weight_scale" not in dict(layers[1].mlp.down_proj.named_parameters())
        assert layers[1].mlp.down_proj.quant.name == "none" and layers[0].mlp.down_proj.quant.name == "fp8"
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference_tokens(hf_model, state)


def test_quantization_fp8_on_a_float_checkpoint(float_models: dict) -> None:
    """Per-channel weights computed at load: the tokens of transformers on those rounded weights."""
    source, hf_model = float_models["Qwen3ForCausalLM", "odd"]
    state = {}
    for name, tensor in hf_model.state_dict().items():  # type: ignore[attr-defined]
        module = name.removesuffix(".weight").rsplit(".", 1)[-1]
        if name.endswith(".weight") and module.endswith("_proj"):
            q, scale = quantize_rows(tensor)
            tensor = dequantize(q, scale, None, torch.float32)
        state[name] = tensor
    with LLM(str(source), device="cpu", quantization="fp8") as llm:
        assert llm.engine.quant.name == "fp8"
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference_tokens(hf_model, state)


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] |= changes
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("layout", "change", "message"),
    [
        ("fp8-block", {"activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
        ("fp8-block", {"scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0' is not supported"),
        ("fp8-block", {"weight_block_size": [128]}, "weight_block_size [128] is not supported"),
        ("fp8-block", {"something_new": 1}, "something_new 1 is not supported"),
        ("ct-channel", {"format": "pack-quantized"}, "format 'pack-quantized' is not supported"),
        ("ct-channel", {"sparsity_config": {"format": "sparse-24"}}, "sparsity_config"),
    ],
)
def test_unsupported_settings_are_refused_by_name(
    float_models: dict, tmp_path: Path, layout: str, change: dict, message: str
) -> None:
    source, _ = float_models["LlamaForCausalLM", "odd"]
    write_fp8_checkpoint(source, tmp_path, layout)
    _edit_config(tmp_path, **change)
    threads = threading.active_count()
    with pytest.raises(ValidationError, match=rf"quantization: quantization method 'fp8': .*{re.escape(message)}"):
        LLM(str(tmp_path), device="cpu")
    gc.collect()
    assert threading.active_count() == threads  # no worker left running


def test_compressed_tensors_group_settings_are_refused_by_name(float_models: dict, tmp_path: Path) -> None:
    source, _ = float_models["LlamaForCausalLM", "odd"]
    write_fp8_checkpoint(source, tmp_path, "ct-channel")
    config = json.loads((tmp_path / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"] |= {"strategy": "tensor", "dynamic": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValidationError,
        match="config_groups.group_0.input_activations .* is not supported \\(dynamic per-token scales only\\)",
    ):
        LLM(str(tmp_path), device="cpu")


def test_a_partly_ignored_fused_layer_is_refused(float_models: dict, tmp_path: Path) -> None:
    source, _ = float_models["LlamaForCausalLM", "odd"]
    write_fp8_checkpoint(source, tmp_path, "fp8-block", ignore=["model.layers.0.self_attn.k_proj"])
    with pytest.raises(ValueError, match="leaves model.layers.0.self_attn.k_proj unquantized"):
        LLM(str(tmp_path), device="cpu")


def test_moe_checkpoints_are_refused(tmp_path: Path) -> None:
    """An FP8 Qwen3-MoE checkpoint, and --quantization fp8 on a bf16 one, are refused by name, each with what to
    do instead: in the engine (LLM) and in the server's preflight, before any worker starts; nothing is left."""
    from minisgl.server.settings import PreflightError, ServeSettings, preflight

    fields = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "head_dim": 16}
    save_tiny_model("Qwen3MoeForCausalLM", tmp_path / "float", **fields)
    write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", "fp8-block")
    model = r"mixture-of-experts model \(Qwen3MoeForCausalLM\): .* not supported yet; "
    checkpoint, online = model + "serve the model's unquantized", model + "leave out --quantization fp8 to serve it"
    threads = threading.active_count()
    with pytest.raises(ValidationError, match=checkpoint):
        LLM(str(tmp_path / "fp8"), device="cpu")
    with pytest.raises(ValidationError, match=online):
        LLM(str(tmp_path / "float"), device="cpu", quantization="fp8")
    refused = "^--quantization: quantization method 'fp8': cannot load this "
    with pytest.raises(PreflightError, match=refused + checkpoint):
        preflight(ServeSettings(model=str(tmp_path / "fp8"), device="cpu"))
    with pytest.raises(PreflightError, match=refused + online):
        preflight(ServeSettings(model=str(tmp_path / "float"), device="cpu", quantization="fp8"))
    gc.collect()
    assert threading.active_count() == threads  # no worker left running


def test_preflight_refuses_unsupported_settings_before_any_worker_starts(float_models: dict, tmp_path: Path) -> None:
    from minisgl.server.settings import PreflightError, ServeSettings, preflight

    source, _ = float_models["LlamaForCausalLM", "odd"]
    write_fp8_checkpoint(source, tmp_path, "fp8-block")
    assert preflight(ServeSettings(model=str(tmp_path), device="cpu"))  # the checkpoint as written passes
    _edit_config(tmp_path, activation_scheme="static")
    refused = r"^--quantization: quantization method 'fp8': .*activation_scheme 'static' is not supported"
    with pytest.raises(PreflightError, match=refused):
        preflight(ServeSettings(model=str(tmp_path), device="cpu"))


@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel"])
def test_tensor_parallel_ranks_load_their_shards(float_models: dict, tmp_path: Path, layout: str) -> None:
    """tp=2 on the CPU: each rank slices the FP8 weight and its scales (block scales by 128-column blocks of
    the row-parallel layers); the greedy tokens are those of transformers on the de-quantized weights."""
    source, hf_model = float_models["LlamaForCausalLM", "even"]
    state = write_fp8_checkpoint(source, tmp_path, layout)
    assert generate(tmp_path, tp=2) == reference_tokens(hf_model, state)


def test_scaled_mm_call_on_torchs_cpu_implementation() -> None:
    """The per-channel GPU path's torch._scaled_mm call (operand layout, scale shapes, bias, 3-D input), run by
    torch's CPU implementation of the same operator, against the float32 W8A8 reference."""
    from minisgl_plugin_fp8 import kernels
    from minisgl_plugin_fp8.reference import reference_w8a8_linear

    torch.manual_seed(0)
    q, scale = quantize_rows(torch.randn(320, 192) * 192**-0.5)
    x = torch.randn(2, 7, 192, dtype=torch.bfloat16)
    bias = torch.randn(320, dtype=torch.bfloat16)
    try:
        y = kernels.scaled_mm_linear(x, q, scale, bias)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"this torch build has no CPU FP8 _scaled_mm: {exc}")
    ref = reference_w8a8_linear(x, q, scale, None, bias)
    assert y.shape == (2, 7, 320) and y.dtype == torch.bfloat16
    assert float((y.float() - ref).norm() / ref.norm()) < 0.01
