"""A quantization method's fused inputs (QuantMethod.fused_input): the decoder layer's norms and the gated MLP's
SiLU x up hand its matmuls quantized activations where it asks for them, the model computes what it computes
without them, and a block the core did not build is never handed one."""

from __future__ import annotations

import types
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from minisgl import LLM, SamplingParams
from minisgl.distributed import SingleCommunicator, TPInfo
from minisgl.layers import (
    FusedInput,
    GatedMLP,
    LinearBase,
    LinearOp,
    QuantizedActivation,
    QuantMethod,
    ReplicatedLinear,
)
from minisgl.models import DecoderLayer
from minisgl.plugins import PluginSource, QuantizationSpec, hookimpl, load_plugins
from minisgl.testing.registry import TEST_MODELS_PLUGIN, _test_models_plugin


def _pow2(y: torch.Tensor) -> QuantizedActivation:
    """``y`` over a power-of-two scale per token: exact, so a matmul of its de-quantized values is ``y``'s."""
    rows = y.reshape(-1, y.shape[-1]).float()
    scale = torch.exp2(torch.ceil(torch.log2(rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-30))))
    return QuantizedActivation(rows / scale, scale, y.dtype)


class Pow2Fused(QuantMethod):
    """Weights in the model's dtype; each matmul takes a :func:`_pow2` activation, made by the producer before
    it at up to ``limit`` tokens. ``got`` counts, per layer shape, the quantized and the plain inputs."""

    name = "pow2"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.got: Counter[tuple[tuple[int, int], bool]] = Counter()

    def make_linear(self, layer: LinearBase) -> LinearOp:
        linear, shape = layer.kernels.linear, (layer.in_features, layer.out_features)

        def op(x: torch.Tensor | QuantizedActivation, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            quantized = isinstance(x, QuantizedActivation)
            self.got[shape, quantized] += 1
            return linear(x.dequantize() if isinstance(x, QuantizedActivation) else x, w, b)

        return op

    def fused_input(self, layer: LinearBase) -> FusedInput:
        kernels = layer.kernels

        def norm(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float):  # noqa: ANN202
            y, summed = kernels.add_rmsnorm(x, residual, w, eps)
            return _pow2(y), summed

        return FusedInput(norm, lambda gate_up: _pow2(kernels.silu_mul(gate_up)), lambda m: m <= self.limit)


def _registry_with(made: list[Pow2Fused], limit: int):  # noqa: ANN202 - a PluginRegistry
    def factory(config: object, dtype: torch.dtype, device: torch.device) -> Pow2Fused:
        made.append(Pow2Fused(limit))
        return made[-1]

    module = types.ModuleType("pow2_plugin")

    @hookimpl
    def minisgl_quantization_methods() -> list[QuantizationSpec]:
        return [QuantizationSpec(name="pow2", factory=factory)]

    module.minisgl_quantization_methods = minisgl_quantization_methods  # type: ignore[attr-defined]
    extra = [PluginSource(TEST_MODELS_PLUGIN, _test_models_plugin()), PluginSource("pow2", module)]
    return load_plugins(only=["builtin", TEST_MODELS_PLUGIN, "pow2"], extra=extra, environ={})


def test_norms_and_silu_hand_quantized_inputs_where_the_method_takes_them(tiny_dir: Path) -> None:
    """Prefill (6 tokens) runs the unfused ops, decode (1 token a step) the method's; the tokens are those of the
    unquantized model, and the attention output projection (fed by attention, no producer of the core's) always
    gets a plain tensor."""
    made: list[Pow2Fused] = []
    registry = _registry_with(made, limit=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [[5, 17, 300, 4, 9, 77]]
    with LLM(str(tiny_dir), registry=registry, page_size=4) as plain:
        want = plain.generate(prompt, params, use_tqdm=False)[0].token_ids
    with LLM(str(tiny_dir), registry=registry, page_size=4, quantization="pow2") as llm:
        got = llm.generate(prompt, params, use_tqdm=False)[0].token_ids
    assert got == want
    (method,) = made
    hidden, inter = _shapes(tiny_dir)
    heads = {shape for shape, _ in method.got}
    qkv = next(s for s in heads if s[0] == hidden and s[1] not in (hidden, 2 * inter))
    gate_up, down = (hidden, 2 * inter), (inter, hidden)
    o_proj = next(s for s in heads if s[1] == hidden and s != down)
    layers = _layers(tiny_dir)
    for shape in (qkv, gate_up, down):
        assert method.got[shape, True] == 7 * layers  # the 7 decode steps after the first token
        assert method.got[shape, False] == layers  # the prompt's forward
    assert method.got[o_proj, True] == 0 and method.got[o_proj, False] == 8 * layers


def _config(path: Path) -> dict:
    import json

    return json.loads((path / "config.json").read_text())


def _shapes(path: Path) -> tuple[int, int]:
    cfg = _config(path)
    return cfg["hidden_size"], cfg["intermediate_size"]


def _layers(path: Path) -> int:
    return _config(path)["num_hidden_layers"]


class _OwnAttention(nn.Module):
    """A block of a plugin's own, reading its input beside its projection: never handed a quantized input."""

    def __init__(self, proj: LinearBase) -> None:
        super().__init__()
        self.proj = proj

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: object) -> torch.Tensor:
        assert isinstance(x, torch.Tensor)
        return self.proj(x) + x


def _decoder_layer(method: Pow2Fused) -> DecoderLayer:
    kw = {"tp": TPInfo(), "comm": SingleCommunicator(), "dtype": torch.float32, "device": torch.device("cpu")}
    attn = _OwnAttention(ReplicatedLinear(16, 16, quant=method, dtype=torch.float32))
    return DecoderLayer(attn, GatedMLP(16, 24, "silu", quant=method, **kw), 16, 1e-6, dtype=torch.float32)


@pytest.mark.parametrize("tokens", [1, 3])
def test_only_the_cores_blocks_are_fed_quantized_inputs(tokens: int) -> None:
    fusing, plain = Pow2Fused(limit=2), Pow2Fused(limit=0)
    layer, reference = _decoder_layer(fusing), _decoder_layer(plain)
    torch.manual_seed(0)
    for param in layer.parameters():
        param.data.normal_()
    reference.load_state_dict(layer.state_dict())
    hidden, positions = torch.randn(tokens, 16), torch.arange(tokens)
    out, residual = layer(positions, hidden, None, None)  # type: ignore[arg-type]  # the block takes no context
    want, want_residual = reference(positions, hidden, None, None)  # type: ignore[arg-type]
    assert torch.equal(out, want) and torch.equal(residual, want_residual)
    fused = tokens <= 2
    assert fusing.got == Counter({((16, 16), False): 1, ((16, 48), fused): 1, ((24, 16), fused): 1})
    assert all(not quantized for _, quantized in plain.got)
