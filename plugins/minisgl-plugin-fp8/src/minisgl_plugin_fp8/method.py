"""The ``fp8`` quantization method: how each linear layer holds FP8 weights and which matmul runs them.

In memory every quantized layer holds ``weight`` (float8_e4m3fn ``[out, in]``) and one float32 scale per output
row (``[out]``: per-channel, or a per-tensor scale repeated) or per output row and block of columns (``[out,
ceil(in / block_k)]``: a checkpoint's ``[ceil(out / block_n), ...]`` block scales repeated down the rows). Scales
that follow the rows load, merge (q/k/v, gate/up) and shard over tensor-parallel ranks exactly as the weight's
rows do. The matmul is chosen once per layer when it is built (:meth:`FP8Method.make_linear`):

- CPU: the reference path. After loading, the weight is de-quantized into the model's dtype and the kernel set's
  float32 ``linear`` runs it (as fast as an unquantized model, and the outputs are those of the de-quantized
  weights);
- CUDA with FP8 tensor cores: ``torch._scaled_mm`` (per-channel/per-tensor) or the Triton block kernel (block
  scales), each quantizing activations per token at run time;
- any other CUDA device or shape: de-quantize on every call, then the ordinary matmul.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from minisgl.layers import UNQUANTIZED, LinearBase, LinearOp, QuantMethod, RowParallelLinear, new_param

from .config import FP8Scheme, parse_config
from .reference import FP8, dequantize, expand_block_scale, quantize_rows

Path = Literal["reference", "scaled_mm", "block", "dequant"]
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fp8_method(config: dict[str, Any] | None, dtype: torch.dtype, device: torch.device) -> FP8Method:
    """The factory of the method ``fp8``: ``config`` is the checkpoint's quantization_config (None: quantize
    an unquantized checkpoint at load, per channel)."""
    if dtype not in _DTYPES:
        raise ValueError(f"FP8 weights run with float32, bfloat16 or float16 activations, not {dtype}")
    return FP8Method(parse_config(config), dtype, device)


class FP8Method(QuantMethod):
    """FP8 weights of the layout ``scheme`` for an engine of activation ``dtype`` on ``device``."""

    name = "fp8"
    supports_moe = False  # the fused MoE experts take no FP8 weights yet

    def __init__(self, scheme: FP8Scheme, dtype: torch.dtype, device: torch.device, paths: Sequence[Path] = ()):
        self.scheme, self.dtype, self.device = scheme, dtype, torch.device(device)
        self.block_k = scheme.block[1] if scheme.block is not None else None
        self._paths = tuple(paths)  # tests force a path; empty: the fastest that applies

    def __repr__(self) -> str:
        return f"FP8Method({self.scheme.layout}, {self.scheme.weight})"

    # ----------------------------------------------------------------- build
    def for_layer(self, checkpoint_names: Sequence[str]) -> QuantMethod:
        ignored = [self.scheme.ignores(n) for n in checkpoint_names]
        if all(ignored):
            return UNQUANTIZED
        if any(ignored):
            kept = [n for n, i in zip(checkpoint_names, ignored, strict=True) if i]
            raise ValueError(
                f"the checkpoint leaves {', '.join(kept)} unquantized but quantizes the other parts of the fused "
                f"layer {', '.join(checkpoint_names)}; minisgl fuses them into one weight, so all or none must be"
            )
        return self

    def create_weights(self, layer: LinearBase, dtype: torch.dtype | None, device: torch.device | None) -> None:
        scheme = self.scheme
        if scheme.layout == "online":  # the checkpoint's weight in the model's dtype, quantized after loading
            return super().create_weights(layer, dtype, device)
        layer.weight = new_param(layer.out_features, layer.in_features, dtype=FP8, device=device)
        layer.weight.weight_loader = layer.load_weight  # type: ignore[attr-defined]
        if self.block_k is not None:
            tp = getattr(layer, "tp", None)
            if (
                isinstance(layer, RowParallelLinear)
                and tp is not None
                and tp.size > 1
                and layer.in_features % self.block_k
            ):
                raise ValueError(
                    f"block-wise FP8 needs each tensor-parallel rank's input size ({layer.in_features}) to be a "
                    f"multiple of the block width {self.block_k}; use a smaller --tp"
                )
            scale = new_param(
                layer.out_features, -(-layer.in_features // self.block_k), dtype=torch.float32, device=device
            )
        else:
            scale = new_param(layer.out_features, dtype=torch.float32, device=device)
        scale.weight_loader = partial(self._load_scale, layer)  # type: ignore[attr-defined]
        setattr(layer, scheme.scale_name, scale)

    def _load_scale(self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """Expand a checkpoint scale to one row of scales per weight row, then load it as the weight's rows."""
        rows = layer.part_rows(shard_id)
        if self.scheme.block is not None:
            per_row = expand_block_scale(loaded, self.scheme.block, rows)
        elif loaded.numel() == 1:  # per tensor
            per_row = loaded.float().reshape(1).expand(rows).contiguous()
        elif loaded.numel() == rows:  # per channel, [rows, 1] in compressed-tensors
            per_row = loaded.float().reshape(rows)
        else:
            raise ValueError(f"scale has shape {tuple(loaded.shape)}, expected one value or one per row ({rows})")
        layer.load_weight(param, per_row, shard_id)

    def path(self, layer: LinearBase) -> Path:
        """The matmul this layer runs (the first of the forced paths, or the fastest that applies)."""
        from .kernels import fp8_gemm_capable, scaled_mm_supports, triton_available

        if self._paths:
            return self._paths[0]
        if self.device.type != "cuda":
            return "reference"
        if not fp8_gemm_capable(self.device):
            return "dequant"
        if self.block_k is None:
            return "scaled_mm" if scaled_mm_supports(layer.in_features, layer.out_features) else "dequant"
        pow2 = self.block_k >= 16 and self.block_k & (self.block_k - 1) == 0
        return "block" if pow2 and triton_available() else "dequant"

    def make_linear(self, layer: LinearBase) -> LinearOp:
        path = self.path(layer)
        layer.fp8_path = path  # type: ignore[assignment]  # what runs, for logs and tests
        if path == "reference":
            return layer.kernels.linear  # on the weight de-quantized after loading
        from . import kernels

        name, block_k = self.scale_name, self.block_k

        def scale_of() -> torch.Tensor:
            return getattr(layer, name)  # type: ignore[no-any-return]

        if path == "scaled_mm":
            return lambda x, w, b: kernels.scaled_mm_linear(x, w, scale_of(), b)
        if path == "block":
            assert block_k is not None
            return lambda x, w, b: kernels.block_linear(x, w, scale_of(), block_k, b)
        return lambda x, w, b: kernels.dequant_linear(x, w, scale_of(), block_k, b)

    @property
    def scale_name(self) -> str:
        return self.scheme.scale_name

    # ------------------------------------------------------------------ load
    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if self.scheme.layout == "online":
            q, scale = quantize_rows(layer.weight.data)
            layer.weight = nn.Parameter(q, requires_grad=False)
            setattr(layer, self.scale_name, nn.Parameter(scale, requires_grad=False))
        if getattr(layer, "fp8_path", None) == "reference":
            scale = getattr(layer, self.scale_name)
            weight = dequantize(layer.weight.data, scale.data, self.block_k, layer.dtype)
            delattr(layer, self.scale_name)
            layer.weight = nn.Parameter(weight, requires_grad=False)
