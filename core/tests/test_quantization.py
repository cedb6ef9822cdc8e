"""The quantization component kind: choosing a method from --quantization and the checkpoint's
quantization_config, refusing what no installed plugin reads (in the engine and in the server's preflight),
and the unquantized built-in keeping today's parameters and matmul."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minisgl import LLM
from minisgl.core import ValidationError
from minisgl.layers import UNQUANTIZED, ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minisgl.plugins import (
    PluginSource,
    QuantizationSpec,
    UnknownComponentError,
    check_compatible,
    choose_quantization,
    load_plugins,
    read_quantization_config,
)
from minisgl.plugins.listing import auto_choices, to_json
from minisgl.utils import VERSION


def _quantized_copy(source: Path, target: Path, quant_config: dict) -> Path:
    target.mkdir()
    for f in source.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quant_config
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_auto_is_none_without_a_quantization_config() -> None:
    registry = load_plugins(only=["builtin"], environ={})
    choice = choose_quantization(registry, "auto", None, "cpu")
    assert choice.spec.name == "none" and choice.config is None
    assert isinstance(choice.spec, QuantizationSpec) and choice.spec.build(None, torch.float32, "cpu") is UNQUANTIZED


def test_a_quant_method_no_plugin_reads_is_refused_naming_it_and_what_is_installed() -> None:
    registry = load_plugins(only=["builtin"], environ={})
    with pytest.raises(UnknownComponentError) as err:
        choose_quantization(registry, "auto", {"quant_method": "awq", "bits": 4}, "cpu")
    message = str(err.value)
    assert message.startswith("the checkpoint is quantized with quant_method 'awq' (config.json, quantization_config)")
    assert "installed quantization methods: none (minisgl)" in message
    assert "`minisgl plugins` lists" in message and "docs/user-guide.md#quantization" in message
    with pytest.raises(UnknownComponentError, match="the quantization method 'none' does not read"):
        choose_quantization(registry, "none", {"quant_method": "awq"}, "cpu")
    with pytest.raises(UnknownComponentError, match="has no quant_method"):
        choose_quantization(registry, "auto", {"bits": 4}, "cpu")
    with pytest.raises(UnknownComponentError, match="unknown quantization method 'fp9'"):
        choose_quantization(registry, "fp9", None, "cpu")


def test_engine_refuses_a_quantized_checkpoint_before_loading_weights(tiny_dir: Path, registry, tmp_path) -> None:
    path = _quantized_copy(tiny_dir, tmp_path / "awq", {"quant_method": "awq"})
    with pytest.raises(ValidationError, match=r"quantization: the checkpoint is quantized with quant_method 'awq'"):
        LLM(str(path), registry=registry)


def test_preflight_refuses_it_before_any_worker_starts(tiny_dir: Path, tmp_path: Path) -> None:
    from minisgl.server.settings import PreflightError, ServeSettings, preflight

    path = _quantized_copy(tiny_dir, tmp_path / "gptq", {"quant_method": "gptq"})
    assert read_quantization_config(path) == {"quant_method": "gptq"}
    assert read_quantization_config(path / "config.json") == {"quant_method": "gptq"}
    assert read_quantization_config(tiny_dir) is None
    with pytest.raises(PreflightError, match=r"^--quantization: the checkpoint is quantized with quant_method 'gptq'"):
        preflight(ServeSettings(model=str(path), device="cpu"))
    assert "builtin" in preflight(ServeSettings(model=str(tiny_dir), device="cpu", quantization="none"))


def test_listing_shows_the_methods_and_auto_leaves_them_to_the_checkpoint() -> None:
    registry = load_plugins(only=["builtin"], environ={})
    rows = to_json(registry, device="cpu")["components"]["quantization"]
    none = next(r for r in rows if r["name"] == "none")
    assert (none["plugin"], none["quant_methods"], none["devices"], none["supported"]) == (
        "builtin",
        [],
        ["cpu", "cuda"],
        True,
    )
    assert "quantization" not in auto_choices(registry, "cpu")


def test_spec_fields_are_checked() -> None:
    with pytest.raises(TypeError, match="QuantizationSpec.quant_methods must be a tuple of strings"):
        QuantizationSpec(name="q", factory="m:f", quant_methods="fp8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="QuantizationSpec.check_config must be a callable or a 'package.module"):
        QuantizationSpec(name="q", factory="m:f", check_config="not a reference")
    spec = QuantizationSpec(name="q", factory="m:f", devices=("cuda",))
    assert spec.unsupported_reason("cpu") == "runs on cuda" and spec.supports("cuda:1")
    spec.check({"quant_method": "q"}, {})  # no check_config: nothing to refuse


def test_a_methods_config_check_runs_in_preflight_and_in_the_engine(tiny_dir: Path, tmp_path: Path) -> None:
    """check_config sees the checkpoint's quantization_config and its config.json; what it refuses stops the
    server before any worker starts and the engine before any weight loads, in the method's own words."""
    from minisgl.server.settings import PreflightError, ServeSettings, preflight
    from minisgl.testing.registry import TEST_MODELS_PLUGIN, _test_models_plugin

    plugin = tmp_path / "q8_plugin.py"
    plugin.write_text(Q8_PLUGIN)
    path = _quantized_copy(tiny_dir, tmp_path / "q4", {"quant_method": "q8", "bits": 4})
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    refused = rf"quantization method 'q8': bits 4 is not supported \(only 8; model_type {model_type}\)"
    with pytest.raises(PreflightError, match=rf"^--quantization: {refused}"):
        preflight(ServeSettings(model=str(path), device="cpu", plugin_paths=str(plugin)))
    extra = [PluginSource(TEST_MODELS_PLUGIN, _test_models_plugin())]
    registry = load_plugins(only=["builtin", TEST_MODELS_PLUGIN], extra=extra, paths=str(plugin), environ={})
    with pytest.raises(ValidationError, match=rf"quantization: {refused}"):
        LLM(str(path), registry=registry)
    ok = _quantized_copy(tiny_dir, tmp_path / "q8", {"quant_method": "q8", "bits": 8})
    with pytest.raises(ValidationError, match="the method 'none' cannot load a quantized checkpoint"):
        LLM(str(ok), registry=registry)  # past the check: this test method's factory is the built-in's


Q8_PLUGIN = """
from minisgl.plugins import QuantizationSpec, hookimpl


def check(config, model_config):
    if config is not None and config.get("bits") != 8:
        kind = model_config.get("model_type")
        raise ValueError(f"bits {config.get('bits')!r} is not supported (only 8; model_type {kind})")


@hookimpl
def minisgl_quantization_methods():
    factory = "minisgl.layers.quant:unquantized"
    return [QuantizationSpec(name="q8", factory=factory, quant_methods=("q8",), check_config=check)]
"""


def test_plugins_made_for_the_previous_api_are_incompatible() -> None:
    assert VERSION.startswith("0.3.")
    assert (
        check_compatible(["minisgl>=0.2,<0.3"], VERSION)
        == f"requires minisgl<0.3,>=0.2, but minisgl {VERSION} is installed"
    )
    assert check_compatible(["minisgl>=0.3,<0.4"], VERSION) == ""


def test_unquantized_layers_keep_their_parameters_and_matmul() -> None:
    """The built-in method costs nothing: the same parameters as before and the kernel set's linear itself."""
    layers = [
        QKVParallelLinear(64, 16, 4, 2, bias=True),
        ColumnParallelLinear(64, [96, 96]),
        RowParallelLinear(96, 64),
    ]
    for layer in layers:
        assert layer.quant is UNQUANTIZED
        assert [n for n, _ in layer.named_parameters()] == (
            ["weight", "bias"] if layer.bias is not None else ["weight"]
        )
        assert layer._linear == layer.kernels.linear
        x = torch.randn(3, layer.in_features)
        layer.weight.data.normal_()
        if layer.bias is not None:  # created empty (it is loaded): garbage, NaN included, until set
            layer.bias.data.normal_()
        assert torch.equal(layer(x), layer.kernels.linear(x, layer.weight, layer.bias))
