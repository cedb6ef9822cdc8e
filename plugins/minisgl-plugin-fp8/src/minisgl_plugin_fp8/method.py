"""The ``fp8`` quantization method: how each linear layer holds FP8 weights and which matmul runs them.

In memory every quantized layer holds ``weight`` (float8_e4m3fn ``[out, in]``) and one float32 scale per output
row (``[out]``: per-channel, or a per-tensor scale repeated) or per output row and block of columns (``[out,
ceil(in / block_k)]``: a checkpoint's ``[ceil(out / block_n), ...]`` block scales repeated down the rows). Scales
that follow the rows load, merge (q/k/v, gate/up) and shard over tensor-parallel ranks exactly as the weight's
rows do. The matmul is chosen once per layer when it is built (:meth:`FP8Method.make_linear`):

- CPU: the reference path. After loading, the weight is de-quantized into the model's dtype and the kernel set's
  float32 ``linear`` runs it (as fast as an unquantized model, and the outputs are those of the de-quantized
  weights);
- CUDA with FP8 tensor cores: per-channel/per-tensor scales run ``torch._scaled_mm`` and block scales the Triton
  block kernel, each quantizing activations per token at run time, until the weights are in. Then the first
  layer of each shape times the other GEMMs that compute the same product (:mod:`.kernels`: fast accumulation,
  cuBLASLt plus a scaling kernel, a Triton W8A8 GEMM in several tiles, weight-only FP8 at decode sizes) at each
  token-count bucket, and every layer of that shape runs the fastest for its bucket (:mod:`.tuning`;
  ``MINISGL_FP8_TUNE=0`` keeps the defaults);
- any other CUDA device or shape: de-quantize on every call, then the ordinary matmul.

Where a layer's GEMM quantizes its input per token, the op before it does that instead, in its own kernel
(:meth:`FP8Method.fused_input`): the decoder layer's two RMSNorms write the q/k/v and gate/up projections' FP8
input, and SiLU x up writes down_proj's (:func:`.kernels.add_rmsnorm_quant`, :func:`.kernels.silu_mul_quant`;
the same values the unfused pair computes). At a token count where the tuned table runs weight-only FP8, the
producers write 16-bit activations as before. ``MINISGL_FP8_FUSE=0`` turns this off.

A mixture-of-experts layer's experts (``w13_weight`` ``[experts, 2 * inter, hidden]``, ``w2_weight``) are FP8 in
the same layouts, with scales ``[experts, rows, k_blocks]`` kept per weight row as above
(:meth:`FP8Method.create_expert_weights`). With a MoE backend that runs FP8 experts (its ``expert_dtypes``: the
``fused`` Triton backend of minisgl-plugin-qwen3-moe, on CUDA) they stay FP8 and the backend de-quantizes each
weight tile as it multiplies; with any other (the built-in ``torch`` backend, the CPU's) they are de-quantized
once after loading into the model's dtype.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.layers import (
    UNQUANTIZED,
    FusedInput,
    LinearBase,
    LinearInput,
    LinearOp,
    QuantizedActivation,
    QuantMethod,
    RowParallelLinear,
    new_param,
)
from minisgl.moe import ExpertScales, MoEExperts

from .config import FP8Scheme, parse_config
from .reference import FP8, dequantize, expand_block_scale, quantize_rows
from .tuning import Candidate, GemmTable, GemmTuner

Path = Literal["reference", "scaled_mm", "scaled_mm_fast", "tensor_epi", "w8a8", "weight_only", "block", "dequant"]
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The Triton W8A8 tiles the tuning tries: (tile, tried above this many tokens, up to this many).
W8A8_TILES: tuple[tuple[tuple[int, int, int, int, int], int, int], ...] = (
    ((16, 32, 256, 4, 4), 0, 32),
    ((16, 64, 256, 4, 4), 0, 32),
    ((16, 64, 128, 4, 5), 0, 32),
    ((32, 64, 128, 4, 4), 16, 64),
    ((64, 64, 128, 4, 4), 32, 512),
    ((64, 128, 128, 4, 4), 32, 1 << 30),
    ((128, 128, 128, 8, 4), 128, 1 << 30),
    ((64, 256, 128, 8, 4), 128, 1 << 30),
    ((128, 256, 128, 8, 3), 512, 1 << 30),
)
#: The GEMMs that quantize their input per token (and so take a :class:`~minisgl.layers.QuantizedActivation`).
PER_TOKEN_PATHS = ("scaled_mm", "scaled_mm_fast", "tensor_epi", "w8a8")
logger = logging.getLogger(__name__)
#: Weight-only FP8 is tried up to this many tokens (beyond, the matmul is no longer bound by the weight's bytes).
WEIGHT_ONLY_MAX_TOKENS = 64


def fp8_method(config: dict[str, Any] | None, dtype: torch.dtype, device: torch.device) -> FP8Method:
    """The factory of the method ``fp8``: ``config`` is the checkpoint's quantization_config (None: quantize
    an unquantized checkpoint at load, per channel). ``MINISGL_FP8_TUNE=0`` in the environment turns the
    load-time GEMM tuning off (each layer then runs its default kernel, the same on every run);
    ``MINISGL_FP8_FUSE=0`` keeps the activation quantization in the GEMMs (no fused RMSNorm or SiLU x up)."""
    if dtype not in _DTYPES:
        raise ValueError(f"FP8 weights run with float32, bfloat16 or float16 activations, not {dtype}")
    return FP8Method(
        parse_config(config), dtype, device, tune=_env_on("MINISGL_FP8_TUNE"), fuse=_env_on("MINISGL_FP8_FUSE")
    )


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


class FP8Method(QuantMethod):
    """FP8 weights of the layout ``scheme`` for an engine of activation ``dtype`` on ``device``."""

    name = "fp8"

    def __init__(
        self,
        scheme: FP8Scheme,
        dtype: torch.dtype,
        device: torch.device,
        paths: Sequence[Path] = (),
        tune: bool = True,
        tuner: GemmTuner | None = None,
        fuse: bool = True,
    ):
        self.scheme, self.dtype, self.device = scheme, dtype, torch.device(device)
        self.block_k = scheme.block[1] if scheme.block is not None else None
        self._paths = tuple(paths)  # tests force a path; empty: the default, then the fastest measured
        self.tune = tune and not self._paths
        self.fuse = fuse  # the producers of per-token layers' inputs quantize them (fused_input)
        self.tuner = tuner or GemmTuner()  # this engine's measurements (one table per layer shape)
        self._one: torch.Tensor | None = None
        self._said_experts = False  # the experts' treatment is logged once per engine

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
                f"the checkpoint leaves {_some(kept)} unquantized but quantizes the other parts of the fused "
                f"layer {_some(checkpoint_names)}; minisgl fuses them into one weight, so all or none must be"
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
        for alias in scheme.scale_aliases:  # the same parameter under the checkpoint's other name for it
            layer.register_parameter(alias, scale)

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
            return layer.kernels.linear  # type: ignore[return-value]  # de-quantized weight; no fused input
        name = self.scale_name
        if path in ("scaled_mm", "block"):  # the default until the weights are in, then the tuned table
            layer.fp8_gemms = GemmTable.single(Candidate(path, self._gemm(path)))  # type: ignore[assignment]

            def tuned(x: LinearInput, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
                table: GemmTable = layer.fp8_gemms  # type: ignore[assignment]
                m = x.tokens if isinstance(x, QuantizedActivation) else x.numel() // x.shape[-1]
                return table.pick(m)(x, w, getattr(layer, name), b)

            return tuned
        gemm = self._gemm(path)
        return lambda x, w, b: gemm(x, w, getattr(layer, name), b)

    def fused_input(self, layer: LinearBase) -> FusedInput | None:
        """The fused RMSNorm and SiLU x up for a layer whose GEMM quantizes per token (CUDA, Triton, per-channel
        or per-tensor weights), taken at each token count where its table runs such a GEMM."""
        from . import kernels

        path = getattr(layer, "fp8_path", None)
        if not (self.fuse and path in PER_TOKEN_PATHS and self.device.type == "cuda" and kernels.triton_available()):
            return None

        def takes(m: int) -> bool:
            table: GemmTable | None = getattr(layer, "fp8_gemms", None)
            return table is None or table.name_at(m).startswith(PER_TOKEN_PATHS)

        silu = kernels.silu_mul_quant if layer.in_features <= kernels.SILU_QUANT_MAX else None
        return FusedInput(kernels.add_rmsnorm_quant, silu, takes)

    def _gemm(self, path: Path, tile: tuple[int, int, int, int, int] | None = None) -> Any:
        """``(x, weight, scale, bias) -> y`` of ``path`` (a GPU path; ``tile`` for the Triton W8A8 GEMM)."""
        from . import kernels

        block_k = self.block_k
        if path == "scaled_mm":
            return kernels.scaled_mm_linear
        if path == "scaled_mm_fast":
            return partial(kernels.scaled_mm_linear, fast_accum=True)
        if path == "tensor_epi":
            if self._one is None:
                self._one = torch.ones((), dtype=torch.float32, device=self.device)
            return partial(kernels.tensor_epilogue_linear, one=self._one)
        if path == "w8a8":
            return partial(kernels.w8a8_linear, tile=tile)
        if path == "weight_only":
            return lambda x, w, s, b: kernels.weight_only_linear(x, w, s, block_k, b)
        if path == "block":
            assert block_k is not None
            return lambda x, w, s, b: kernels.block_linear(x, w, s, block_k, b)
        return lambda x, w, s, b: kernels.dequant_linear(x, w, s, block_k, b)

    def candidates(self, path: Path) -> list[Candidate]:
        """What the tuning times for a layer whose default is ``path`` (the default first)."""
        from .kernels import triton_available

        found = [Candidate(path, self._gemm(path))]
        triton = triton_available()
        sixteen_bit = self.dtype in (torch.bfloat16, torch.float16)
        if path == "scaled_mm":
            found.append(Candidate("scaled_mm_fast", self._gemm("scaled_mm_fast")))
            if triton:
                found.append(Candidate("tensor_epi", self._gemm("tensor_epi")))
                for tile, lo, hi in W8A8_TILES:
                    label = "w8a8_{}x{}x{}_w{}s{}".format(*tile)
                    found.append(Candidate(label, self._gemm("w8a8", tile), partial(_between, lo, hi)))
        if triton and sixteen_bit and path in ("scaled_mm", "block"):
            fits = partial(_between, 0, WEIGHT_ONLY_MAX_TOKENS)
            found.append(Candidate("weight_only", self._gemm("weight_only"), fits))
        return found

    @property
    def scale_name(self) -> str:
        return self.scheme.scale_name

    # ------------------------------------------------------------------ load
    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if self.scheme.layout == "online":
            q, scale = quantize_rows(layer.weight.data)
            layer.weight = nn.Parameter(q, requires_grad=False)
            setattr(layer, self.scale_name, nn.Parameter(scale, requires_grad=False))
        path = getattr(layer, "fp8_path", None)
        if path == "reference":
            scale = getattr(layer, self.scale_name)
            weight = dequantize(layer.weight.data, scale.data, self.block_k, layer.dtype)
            for name in (self.scale_name, *self.scheme.scale_aliases):
                delattr(layer, name)
            layer.weight = nn.Parameter(weight, requires_grad=False)
        elif self.tune and path in ("scaled_mm", "block") and layer.weight.is_cuda:
            self._tune(layer, path)

    def _tune(self, layer: LinearBase, path: Path) -> None:
        """Give ``layer`` the fastest GEMM per token-count bucket, measured on the first layer of its shape."""
        weight, scale = layer.weight.data, getattr(layer, self.scale_name).data
        param = getattr(layer, "bias", None)
        bias = param.data if param is not None else None
        key = (path, weight.shape[0], weight.shape[1], bias is not None)
        exact = None

        def reference(x: torch.Tensor) -> torch.Tensor:
            nonlocal exact
            if exact is None:  # made on the shape's first layer only, and dropped with this closure
                exact = dequantize(weight, scale, self.block_k, self.dtype)
            return F.linear(x, exact, bias)

        table = self.tuner.table(key, self.candidates(path), weight, scale, bias, reference, self.dtype)
        layer.fp8_gemms = table  # type: ignore[assignment]

    # --------------------------------------------------------------- experts
    def create_expert_weights(
        self, experts: MoEExperts, dtype: torch.dtype | None, device: torch.device | None
    ) -> None:
        if self.scheme.layout == "online":  # the checkpoint's experts in the model's dtype, quantized after loading
            return super().create_expert_weights(experts, dtype, device)
        e, n, hidden, bk = experts.num_experts, experts.local_inter, experts.hidden_size, self.block_k
        if bk is not None and experts.tp.size > 1 and n % bk:
            raise ValueError(
                f"block-wise FP8 experts need each tensor-parallel rank's expert intermediate size ({n}) to be a "
                f"multiple of the block width {bk}; use a smaller --tp"
            )
        experts.w13_weight = new_param(e, 2 * n, hidden, dtype=FP8, device=device)
        experts.w2_weight = new_param(e, hidden, n, dtype=FP8, device=device)
        for weight in (experts.w13_weight, experts.w2_weight):
            weight.weight_loader = experts.load_weight  # type: ignore[attr-defined]
        blocks = (-(-hidden // bk), -(-n // bk)) if bk is not None else (1, 1)
        for prefix, rows, k_blocks in (("w13", 2 * n, blocks[0]), ("w2", hidden, blocks[1])):
            # NaN until loaded: a checkpoint that leaves out some expert's scale is refused after loading.
            scale = nn.Parameter(torch.full((e, rows, k_blocks), float("nan"), device=device), requires_grad=False)
            scale.weight_loader = partial(self._load_expert_scale, experts)  # type: ignore[attr-defined]
            for name in (self.scale_name, *self.scheme.scale_aliases):
                experts.register_parameter(f"{prefix}_{name}", scale)

    def _load_expert_scale(
        self, experts: MoEExperts, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Expand one expert's checkpoint scale to one row of scales per weight row, then load it as its rows."""
        part, expert = shard_id if isinstance(shard_id, tuple) and len(shard_id) == 2 else (None, None)
        if expert is None:
            raise ValueError(f"FP8 expert scales load per expert (experts.<e>.<part>_proj), not as {shard_id!r}")
        rows = experts.hidden_size if part == "down" else experts.intermediate_size
        if self.scheme.block is not None:
            per_row = expand_block_scale(loaded, self.scheme.block, rows)
        elif loaded.numel() == 1:
            per_row = loaded.float().reshape(1, 1).expand(rows, 1).contiguous()
        elif loaded.numel() == rows:
            per_row = loaded.float().reshape(rows, 1)
        else:
            raise ValueError(f"scale has shape {tuple(loaded.shape)}, expected one value or one per row ({rows})")
        experts.load_weight(param, per_row, shard_id)

    def process_expert_weights_after_loading(self, experts: MoEExperts) -> None:
        found = {p: self._expert_weight(experts, p) for p in ("w13", "w2")}
        for p in ("w13", "w2"):
            for name in (self.scale_name, *self.scheme.scale_aliases):
                if hasattr(experts, f"{p}_{name}"):
                    delattr(experts, f"{p}_{name}")
        runs_fp8 = FP8 in experts.backend.expert_dtypes  # else de-quantized once, for any backend
        dtype = experts.dtype or self.dtype
        if not self._said_experts:
            self._said_experts = True
            backend = type(experts.backend).__name__
            if runs_fp8:
                logger.info("fp8: MoE experts stay in FP8 (%s runs them)", backend)
            else:
                logger.info("fp8: MoE experts de-quantized to %s at load (%s takes no FP8 experts)", dtype, backend)
        for p, (weight, scale) in found.items():
            if runs_fp8:
                setattr(experts, f"{p}_weight", nn.Parameter(weight, requires_grad=False))
                setattr(experts, f"{p}_{self.scale_name}", nn.Parameter(scale.contiguous(), requires_grad=False))
                continue
            out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
            for e in range(weight.shape[0]):  # one expert at a time: float32 of one expert's matrix at most
                out[e] = dequantize(
                    weight[e], scale[e] if self.block_k is not None else scale[e, :, 0], self.block_k, dtype
                )
            setattr(experts, f"{p}_weight", nn.Parameter(out, requires_grad=False))
        experts.scales = None
        if runs_fp8:
            w13, w2 = (getattr(experts, f"{p}_{self.scale_name}") for p in ("w13", "w2"))
            experts.scales = ExpertScales(w13, w2, self.block_k)

    def _expert_weight(self, experts: MoEExperts, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(FP8 weight, scale [experts, rows, k_blocks])`` of ``w13`` or ``w2``, quantized here if online."""
        weight = getattr(experts, f"{prefix}_weight").data
        if self.scheme.layout == "online":  # one expert at a time, as de-quantizing does
            q = torch.empty(weight.shape, dtype=FP8, device=weight.device)
            scale = torch.empty(weight.shape[0], weight.shape[1], 1, device=weight.device)
            for e in range(weight.shape[0]):
                q[e], scale[e, :, 0] = quantize_rows(weight[e])
            return q, scale
        scale = getattr(experts, f"{prefix}_{self.scale_name}").data
        if torch.isnan(scale).any():
            missing = torch.isnan(scale).flatten(1).any(dim=1).nonzero().flatten().tolist()
            part = "gate_proj and up_proj" if prefix == "w13" else "down_proj"
            raise KeyError(
                f"the checkpoint has no {self.scale_name} for the {part} of expert(s) "
                f"{_some([str(e) for e in missing])} of a layer"
            )
        return weight, scale


def _some(names: Sequence[str], shown: int = 4) -> str:
    """``names`` joined, the first ``shown`` of them when there are more."""
    if len(names) <= shown:
        return ", ".join(names)
    return ", ".join(names[:shown]) + f" and {len(names) - shown} more"


def _between(lo: int, hi: int, m: int) -> bool:
    return lo < m <= hi
