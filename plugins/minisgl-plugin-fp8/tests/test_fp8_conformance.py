"""The method 'fp8' against the quantization conformance kit, in each checkpoint layout: every linear layer
kind (merged, fused QKV, row-parallel, at tensor-parallel rank 1 of 2 too) loaded from the layout's tensors
equals the float32 product of the de-quantized weights (the CPU reference path; CUDA: test_fp8_gpu.py)."""

from __future__ import annotations

import torch
from minisgl_plugin_fp8.config import parse_config
from minisgl_plugin_fp8.method import FP8Method
from minisgl_plugin_fp8.testing import quantization_config, quantize_weight

from minisgl.testing.quantization import QuantMethodConformance


class TestFP8Block(QuantMethodConformance):
    method = "fp8"
    layout = "fp8-block"
    config = quantization_config("fp8-block")

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return quantize_weight(weight, self.layout)[0]

    def dequantize(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        w, scale = tensors["weight"].float(), tensors.get("weight_scale_inv", tensors.get("weight_scale"))
        assert scale is not None
        if self.layout == "fp8-block":
            scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        return w * scale


class TestFP8PerTensor(TestFP8Block):
    layout = "fp8-tensor"
    config = quantization_config("fp8-tensor")


class TestCompressedTensorsChannel(TestFP8Block):
    layout = "ct-channel"
    config = quantization_config("ct-channel")


class TestCompressedTensorsTensor(TestFP8Block):
    layout = "ct-tensor"
    config = quantization_config("ct-tensor")


def _forced(path: str):  # noqa: ANN202 - a quantization factory
    def factory(config: dict | None, dtype: torch.dtype, device: torch.device) -> FP8Method:
        return FP8Method(parse_config(config), dtype, device, paths=(path,))

    return factory


class TestDequantPathBlock(TestFP8Block):
    """The GPU fallback (de-quantize on every call, bf16 matmul), forced on the CPU."""

    method = staticmethod(_forced("dequant"))
    dtype = torch.bfloat16
    max_rel_err = 0.02  # bf16 weights, activations and output


class TestDequantPathChannel(TestDequantPathBlock):
    layout = "ct-channel"
    config = quantization_config("ct-channel")


class TestScaledMMPathOnCPU(TestFP8Block):
    """The per-channel GPU path's layer wiring (torch._scaled_mm, which torch also runs on the CPU)."""

    method = staticmethod(_forced("scaled_mm"))
    layout = "ct-channel"
    config = quantization_config("ct-channel")
    dtype = torch.bfloat16
    max_rel_err = 0.08  # activations quantized to FP8 per token
