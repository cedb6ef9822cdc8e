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
from minisgl.moe import TorchMoEBackend
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


@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel", "fp8-tensor"])
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


def rounded_per_row(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ``--quantization fp8`` makes of a float state dict: every ``*_proj`` weight (experts' too)
    quantized per row and de-quantized (float32), the rest as is."""
    state = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight").rsplit(".", 1)[-1]
        if name.endswith(".weight") and module.endswith("_proj"):
            q, scale = quantize_rows(tensor)
            tensor = dequantize(q, scale, None, torch.float32)
        state[name] = tensor
    return state


def test_quantization_fp8_on_a_float_checkpoint(float_models: dict) -> None:
    """Per-channel weights computed at load: the tokens of transformers on those rounded weights."""
    source, hf_model = float_models["Qwen3ForCausalLM", "odd"]
    state = rounded_per_row(hf_model.state_dict())  # type: ignore[attr-defined]
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


# A tiny Qwen3-MoE whose expert sizes are not multiples of 128 (partial scale blocks): 4 experts, top-2.
MOE_FIELDS = {
    "hidden_size": 192,
    "moe_intermediate_size": 160,
    "intermediate_size": 320,
    "num_attention_heads": 6,
    "head_dim": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


def hf_tokens_of(path: Path, state: dict[str, torch.Tensor], tmp: Path) -> list[list[int]]:
    """transformers' greedy tokens for the float32 weights ``state`` of the model in ``path`` (config copied,
    its quantization_config dropped), loaded through ``from_pretrained`` as a checkpoint would be."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config))
    save_file({k: v.float().contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
    return hf_greedy(model, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def float_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-moe")
    save_tiny_model("Qwen3MoeForCausalLM", path, **MOE_FIELDS)
    return path


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_checkpoint_matches_transformers_on_dequantized_weights(
    float_moe: Path, tmp_path: Path, layout: str
) -> None:
    """FP8 experts (per expert, as the tools write Qwen3-MoE FP8 checkpoints) and FP8 attention, router left
    in bf16: on the CPU they are de-quantized once after loading, so the tokens are transformers' on those weights."""
    state = write_fp8_checkpoint(float_moe, tmp_path / "fp8", layout)
    with LLM(str(tmp_path / "fp8"), device="cpu") as llm:
        experts = llm.engine.model.model.layers[0].mlp.experts
        assert experts.quant.name == "fp8" and experts.scales is None  # de-quantized: the torch backend runs them
        assert experts.w13_weight.dtype == experts.w2_weight.dtype == llm.engine.dtype
        assert not [n for n, _ in experts.named_parameters() if "scale" in n]
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        llm.check_accounting()
    assert [o.token_ids for o in outs] == hf_tokens_of(tmp_path / "fp8", state, tmp_path / "reference")


class FP8ReadingBackend(TorchMoEBackend):
    """The torch backend over FP8 experts: de-quantizes each active expert's weights with ``scales`` per call
    (what the fused backend does tile by tile), so the experts stay FP8 after loading."""

    expert_dtypes = (torch.float8_e4m3fn,)

    def forward(self, hidden, w13, w2, topk_weights, topk_ids, scales=None):  # type: ignore[no-untyped-def]
        assert scales is not None and w13.dtype == w2.dtype == torch.float8_e4m3fn
        calls.append(scales.block_k)

        def real(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            width = scales.block_k or w.shape[-1]
            return (w.float() * s.repeat_interleave(width, dim=-1)[..., : w.shape[-1]]).to(hidden.dtype)

        return super().forward(hidden, real(w13, scales.w13), real(w2, scales.w2), topk_weights, topk_ids)


calls: list[int | None] = []


def fp8_backend_registry():  # type: ignore[no-untyped-def]
    import types

    from minisgl.plugins import MoEBackendSpec, PluginSource, hookimpl, load_plugins

    module = types.ModuleType("fp8_reading_moe")

    @hookimpl
    def minisgl_moe_backends() -> list[MoEBackendSpec]:
        return [MoEBackendSpec(name="fp8-reading", factory=FP8ReadingBackend)]

    module.minisgl_moe_backends = minisgl_moe_backends  # type: ignore[attr-defined]
    source = PluginSource("fp8-reading", module)
    return load_plugins(only=["builtin", "fp8", "qwen3_moe", "fp8-reading"], extra=[source], environ={})


@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel", "fp8-tensor"])
def test_a_backend_that_reads_fp8_experts_gets_them_with_their_scales(
    float_moe: Path, tmp_path: Path, layout: str
) -> None:
    """With a backend listing float8 in ``expert_dtypes`` the experts stay FP8 and every call gets their scales
    (per row and block of 128 input columns, or per row): the tokens are those of the de-quantized weights."""
    state = write_fp8_checkpoint(float_moe, tmp_path / "fp8", layout)
    calls.clear()
    with LLM(str(tmp_path / "fp8"), device="cpu", moe_backend="fp8-reading", registry=fp8_backend_registry()) as llm:
        experts = llm.engine.model.model.layers[0].mlp.experts
        block = 128 if layout == "fp8-block" else None
        assert experts.scales is not None and experts.scales.block_k == block
        k_blocks = 2 if block else 1  # hidden 192 and expert size 160: a whole block and a partial one
        assert tuple(experts.scales.w13.shape) == (4, 2 * 160, k_blocks)
        assert tuple(experts.scales.w2.shape) == (4, 192, k_blocks)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert calls and set(calls) == {block}
    assert [o.token_ids for o in outs] == hf_tokens_of(tmp_path / "fp8", state, tmp_path / "reference")


def test_quantization_fp8_on_a_float_moe_checkpoint(float_moe: Path, tmp_path: Path) -> None:
    """``--quantization fp8`` quantizes every linear layer and every expert matrix per row at load."""
    from safetensors.torch import load_file

    state = rounded_per_row(load_file(str(float_moe / "model.safetensors")))
    with LLM(str(float_moe), device="cpu", quantization="fp8") as llm:
        assert llm.engine.model.model.layers[1].mlp.experts.quant.name == "fp8"
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_tokens_of(float_moe, state, tmp_path / "reference")


def test_moe_checkpoints_pass_the_preflight(float_moe: Path, tmp_path: Path) -> None:
    from minisgl.server.settings import ServeSettings, preflight

    write_fp8_checkpoint(float_moe, tmp_path / "fp8", "fp8-block")
    preflight(ServeSettings(model=str(tmp_path / "fp8"), device="cpu"))
    preflight(ServeSettings(model=str(float_moe), device="cpu", quantization="fp8"))


def test_a_missing_expert_scale_is_refused_by_name(float_moe: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    write_fp8_checkpoint(float_moe, tmp_path, "fp8-block")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    threads = threading.active_count()
    with pytest.raises(KeyError, match=r"no weight_scale_inv for the gate_proj and up_proj of expert\(s\) 2 "):
        LLM(str(tmp_path), device="cpu")
    gc.collect()
    assert threading.active_count() == threads  # no worker left running


@pytest.mark.parametrize("layout", ["fp8-block", "fp8-tensor"])  # fp8-tensor: a scale under two names
def test_experts_left_unquantized_load_as_float(float_moe: Path, tmp_path: Path, layout: str) -> None:
    """A checkpoint that leaves one layer's experts unquantized (modules_to_not_convert) loads them as float."""
    state = write_fp8_checkpoint(float_moe, tmp_path / "fp8", layout, ignore=["model.layers.1.mlp.experts."])
    with LLM(str(tmp_path / "fp8"), device="cpu") as llm:
        layers = llm.engine.model.model.layers
        assert layers[1].mlp.experts.quant.name == "none" and layers[0].mlp.experts.quant.name == "fp8"
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_tokens_of(tmp_path / "fp8", state, tmp_path / "reference")


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


@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel"])
def test_tensor_parallel_ranks_load_their_expert_shards(tmp_path: Path, layout: str) -> None:
    """tp=2 on the CPU with FP8 experts: each rank takes its gate/up rows and down columns of every expert and
    the matching scales (block scales: down's 128-column blocks; per-row scales whole)."""
    fields = {**MOE_FIELDS, "hidden_size": 256, "moe_intermediate_size": 256, "num_attention_heads": 4, "head_dim": 64}
    save_tiny_model("Qwen3MoeForCausalLM", tmp_path / "float", **fields)
    state = write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", layout)
    tokens = generate(tmp_path / "fp8", tp=2)
    assert tokens == hf_tokens_of(tmp_path / "fp8", state, tmp_path / "reference")


def test_block_experts_that_do_not_split_into_whole_blocks_are_refused(tmp_path: Path) -> None:
    """Attention splits into whole 128-column blocks at tp=2, the experts (160: 80 per rank) do not."""
    fields = {**MOE_FIELDS, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "intermediate_size": 512}
    save_tiny_model("Qwen3MoeForCausalLM", tmp_path / "float", **fields)
    write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", "fp8-block")
    with pytest.raises(ValueError, match=r"expert intermediate size \(80\) to be a multiple of the block width 128"):
        LLM(str(tmp_path / "fp8"), device="cpu", tp=2)
    children = " ".join(p.read_text() for p in Path("/proc/self/task").glob("*/children"))
    assert not children.split(), f"rank processes left running: {children}"


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
