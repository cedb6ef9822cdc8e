"""Entry module: declares the quantization method ``fp8``; torch and the kernels load only when it is built."""

from __future__ import annotations

from collections.abc import Iterable

from minisgl.plugins import QuantizationSpec, hookimpl


@hookimpl
def minisgl_quantization_methods() -> Iterable[QuantizationSpec]:
    return [
        QuantizationSpec(
            name="fp8",
            factory="minisgl_plugin_fp8.method:fp8_method",
            check_config="minisgl_plugin_fp8.config:check_config",
            quant_methods=("fp8", "compressed-tensors"),
            devices=("cpu", "cuda"),
            dtypes=("bfloat16", "float16", "float32"),
            description="FP8 (e4m3) weights: Hugging Face fp8 (block or per-tensor scales), compressed-tensors "
            "FP8 W8A8 (per channel), or --quantization fp8 on a bf16 checkpoint; dynamic activation scales",
        )
    ]
