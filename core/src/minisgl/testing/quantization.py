"""Conformance kit for quantization methods: each linear layer kind, built by the method and loaded from
quantized checkpoint tensors, against the float32 product of the weights those tensors de-quantize to.

Subclass :class:`QuantMethodConformance` in a test module, with a name starting with ``Test``, and say how a
float weight becomes checkpoint tensors (as the tool that writes your format does) and what they stand for::

    from minisgl.testing.quantization import QuantMethodConformance

    class TestMyInt8(QuantMethodConformance):
        method = "myint8"                                  # registry name, QuantizationSpec or factory
        config = {"quant_method": "myint8", "bits": 8}     # the checkpoint's quantization_config

        def quantize(self, weight):                        # [out, in] float32 -> tensors by name suffix
            scale = weight.abs().amax(1, keepdim=True) / 127
            return {"weight": (weight / scale).round().to(torch.int8), "weight_scale": scale}

        def dequantize(self, tensors):                     # -> the float32 weight they stand for
            return tensors["weight"].float() * tensors["weight_scale"]

Layers: a replicated linear, a merged column-parallel one (gate/up: two blocks loaded by index), the fused
QKV projection (q, k and v loaded by shard id) and a row-parallel one, at tensor-parallel rank 0 of 1 and rank
1 of 2, with sizes that are not multiples of 128 (192, 320) and ones that are (256, 512). Each checkpoint tensor
goes through its parameter's ``weight_loader`` in the parameter's dtype (as ``CausalLM.load_weights`` does), then
``process_weights_after_loading``; the layer's output on 1, 7 and 40 rows must be within ``max_rel_err``
(relative Frobenius error) of ``x @ W.T`` for this rank's slice of the de-quantized weight, in float32. A scale
of the wrong shape must be refused (``ValueError``). Set ``device``/``dtype`` for a GPU method and raise
``max_rel_err`` where activations are quantized too.

Mixture-of-experts layers, for a method that overrides ``create_expert_weights``: each expert's gate, up and
down matrices quantized by :meth:`quantize` and loaded per expert (``w13_<suffix>`` / ``w2_<suffix>``, shard id
``(part, expert)``), then ``process_expert_weights_after_loading``; the layer (run by ``expert_backend()``, the
``torch`` backend by default: set it to a backend listing your weights' dtype in ``expert_dtypes`` to test that
path) must be within ``max_rel_err`` of the ``torch`` backend on this rank's slices of the de-quantized weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from ..distributed import TPInfo
from ..layers import (
    ColumnParallelLinear,
    LinearBase,
    QKVParallelLinear,
    QuantMethod,
    ReplicatedLinear,
    RowParallelLinear,
)
from ..moe import BaseMoEBackend, MoEExperts, TorchMoEBackend, route
from ..plugins import ComponentSpec, load_plugins, resolve

TP = {"tp1": TPInfo(0, 1), "rank1of2": TPInfo(1, 2)}
LAYERS = ("replicated", "merged", "qkv", "row")
HEAD_DIM, HEADS, KV_HEADS = 32, 6, 2


class QuantMethodConformance:
    """Base class of a quantization method's conformance tests. Set ``method`` and ``config`` and write
    :meth:`quantize` and :meth:`dequantize`; the rest has defaults."""

    method: str | ComponentSpec | Callable[..., QuantMethod]
    config: dict[str, Any] | None = None
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    max_rel_err: float = 1e-5
    #: The MoE backend the experts test runs (a callable returning one).
    expert_backend: Callable[[], BaseMoEBackend] = TorchMoEBackend

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Checkpoint tensors of one ``[out, in]`` float32 weight, by the suffix after the module name."""
        raise NotImplementedError

    def dequantize(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 ``[out, in]`` weight that ``tensors`` stand for."""
        raise NotImplementedError

    def make_method(self) -> QuantMethod:
        ref = self.method
        if isinstance(ref, str) and ":" not in ref:
            ref = load_plugins().get("quantization", ref)
        factory = ref.load_factory() if isinstance(ref, ComponentSpec) else resolve(ref)
        return factory(self.config, self.dtype, torch.device(self.device))  # type: ignore[no-any-return]

    @pytest.fixture
    def quant(self) -> QuantMethod:
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        return self.make_method()

    # ------------------------------------------------------------------ cases
    def build(self, kind: str, quant: QuantMethod, tp: TPInfo) -> tuple[LinearBase, dict[Any, torch.Tensor]]:
        """The layer, and the full float weight of each checkpoint part by shard id (None: one tensor)."""
        kw: dict[str, Any] = {"dtype": self.dtype, "device": torch.device(self.device), "quant": quant}
        gen = torch.Generator().manual_seed(LAYERS.index(kind))

        def weight(out: int, inp: int) -> torch.Tensor:
            return torch.randn(out, inp, generator=gen) * inp**-0.5

        layer: LinearBase
        parts: dict[Any, torch.Tensor]
        if kind == "replicated":
            layer, parts = ReplicatedLinear(192, 320, **kw), {None: weight(320, 192)}
        elif kind == "merged":
            layer = ColumnParallelLinear(192, [320, 320], tp=tp, **kw)
            parts = {0: weight(320, 192), 1: weight(320, 192)}
        elif kind == "qkv":
            layer = QKVParallelLinear(256, HEAD_DIM, HEADS, KV_HEADS, tp=tp, **kw)
            parts = {"q": weight(HEADS * HEAD_DIM, 256), "k": weight(KV_HEADS * HEAD_DIM, 256)}
            parts["v"] = weight(KV_HEADS * HEAD_DIM, 256)
        else:
            layer, parts = RowParallelLinear(512, 192, tp=tp, **kw), {None: weight(192, 512)}
        return layer, parts

    @staticmethod
    def local_weight(layer: LinearBase, parts: dict[Any, torch.Tensor]) -> torch.Tensor:
        """This rank's slice of the full weight, as the layer holds it."""
        if isinstance(layer, RowParallelLinear):
            w = parts[None]
            return w[:, layer.tp.rank * layer.in_features : (layer.tp.rank + 1) * layer.in_features]
        if isinstance(layer, QKVParallelLinear):
            q = parts["q"].narrow(0, layer.tp.rank * layer.sizes["q"], layer.sizes["q"])
            start, size = layer.kv_head_start * layer.head_dim, layer.sizes["k"]
            return torch.cat([q, parts["k"].narrow(0, start, size), parts["v"].narrow(0, start, size)])
        if isinstance(layer, ColumnParallelLinear):
            rank = layer.tp.rank
            return torch.cat([parts[i].narrow(0, rank * n, n) for i, n in enumerate(layer.local_sizes)])
        return parts[None]

    @staticmethod
    def load(layer: LinearBase, tensors: dict[str, torch.Tensor], shard_id: Any) -> None:
        params = dict(layer.named_parameters())
        for suffix, tensor in tensors.items():
            if suffix not in params:
                raise AssertionError(f"{type(layer).__name__} has no parameter '{suffix}' (has {', '.join(params)})")
            param = params[suffix]
            loader = param.weight_loader  # type: ignore[attr-defined]
            loader(param, tensor.to(device=param.device, dtype=param.dtype), *(() if shard_id is None else (shard_id,)))

    # ------------------------------------------------------------------ tests
    @pytest.mark.parametrize("tp", list(TP))
    @pytest.mark.parametrize("kind", LAYERS)
    def test_layer_matches_the_dequantized_weights(self, quant: QuantMethod, kind: str, tp: str) -> None:
        layer, parts = self.build(kind, quant, TP[tp])
        dequantized = {}
        for shard_id, full in parts.items():
            tensors = self.quantize(full)
            self.load(layer, tensors, shard_id)
            dequantized[shard_id] = self.dequantize(tensors).float()
        quant.process_weights_after_loading(layer)
        w = self.local_weight(layer, dequantized).to(self.device)
        for rows in (1, 7, 40):
            x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
            x = x.to(device=self.device, dtype=self.dtype)
            with torch.inference_mode():
                y = layer(x)
            ref = x.float() @ w.t()
            assert y.shape == ref.shape, f"{kind} {tp}: output shape {tuple(y.shape)}, expected {tuple(ref.shape)}"
            err = float((y.float() - ref).norm() / ref.norm())
            assert err <= self.max_rel_err, f"{kind} {tp}, {rows} rows: relative error {err:.2e} > {self.max_rel_err}"

    def test_a_scale_of_the_wrong_shape_is_refused(self, quant: QuantMethod) -> None:
        layer, parts = self.build("merged", quant, TP["tp1"])
        tensors = self.quantize(parts[0])
        extra = [s for s in tensors if s != "weight"]
        if not extra:
            pytest.skip("the method stores no tensor besides the weight")
        name = extra[0]
        bad = torch.cat([tensors[name].reshape(-1)] * 3).reshape(-1, 1, 1)  # wrong size and rank
        with pytest.raises((ValueError, RuntimeError)):
            self.load(layer, {name: bad}, 0)

    @pytest.mark.parametrize("tp", list(TP))
    def test_experts_match_the_dequantized_weights(self, quant: QuantMethod, tp: str) -> None:
        if type(quant).create_expert_weights is QuantMethod.create_expert_weights or not quant.supports_moe:
            pytest.skip("the method does not quantize mixture-of-experts layers")
        info = TP[tp]
        # Not multiples of 128 at one rank; whole blocks of 128 per rank at two.
        hidden, inter, experts = (192, 160, 3) if info.size == 1 else (256, 256, 3)
        device = torch.device(self.device)
        backend = type(self).expert_backend()
        layer = MoEExperts(
            experts, hidden, inter, backend=backend, tp=info, dtype=self.dtype, device=device, quant=quant
        )
        params = dict(layer.named_parameters())
        gen = torch.Generator().manual_seed(11)
        w13 = torch.empty(experts, 2 * layer.local_inter, hidden)
        w2 = torch.empty(experts, hidden, layer.local_inter)
        lo, n = info.rank * layer.local_inter, layer.local_inter
        for e in range(experts):
            for part, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
                full = torch.randn(*shape, generator=gen) * shape[1] ** -0.5
                tensors = self.quantize(full)
                for suffix, tensor in tensors.items():
                    name = f"{'w2' if part == 'down' else 'w13'}_{suffix}"
                    if name not in params:
                        raise AssertionError(f"MoEExperts has no parameter '{name}' (has {', '.join(params)})")
                    param = params[name]
                    param.weight_loader(param, tensor.to(device=param.device, dtype=param.dtype), (part, e))  # type: ignore[attr-defined]
                real = self.dequantize(tensors).float()
                if part == "down":
                    w2[e] = real[:, lo : lo + n]
                else:
                    w13[e, (0 if part == "gate" else n) : (0 if part == "gate" else n) + n] = real[lo : lo + n]
        quant.process_expert_weights_after_loading(layer)
        for tokens in (1, 7, 40):
            g = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=self.dtype)
            weights, ids = route(torch.randn(tokens, experts, generator=g).to(device), 2, True)
            with torch.inference_mode():
                y = layer(x, weights, ids)
            ref = TorchMoEBackend().forward(x.float(), w13.to(device), w2.to(device), weights, ids)
            assert y.shape == ref.shape, f"experts {tp}: output shape {tuple(y.shape)}, expected {tuple(ref.shape)}"
            err = float((y.float() - ref).norm() / ref.norm())
            assert err <= self.max_rel_err, (
                f"experts {tp}, {tokens} tokens: relative error {err:.2e} > {self.max_rel_err}"
            )
