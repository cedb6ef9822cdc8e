"""Tensor-parallel linear layers. Each parameter's ``weight_loader(param, tensor, shard_id=None)`` copies this
rank's slice of a full checkpoint tensor, so model files never deal with sharding. ``shard_id`` picks a part of a
fused weight ("q"/"k"/"v", or a merged block's index); without one, a fused weight loads from one tensor holding
every part in order (``[q; k; v]``, ``[gate; up]``, as Phi-3 stores them). A layer's
:class:`~minisgl.layers.quant.QuantMethod` creates its weight (and any scales) and picks its matmul, once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import Communicator, SingleCommunicator, TPInfo
from ..kernel import KernelSet, select_kernels
from .quant import UNQUANTIZED, FusedInput, LinearInput, LinearOp, QuantMethod


def set_loader(param: nn.Parameter, loader: Callable[..., None]) -> None:
    """Attach ``loader(param, tensor, shard_id=None)`` to ``param``: :meth:`CausalLM.load_weights` calls it with
    each checkpoint tensor of that name (already cast to the parameter's dtype). A layer whose checkpoint stores a
    tensor differently from how it computes with it (transposed, offset, split) converts it here, once."""
    param.weight_loader = loader  # type: ignore[attr-defined]


def default_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a checkpoint tensor of exactly the parameter's shape (a replicated, unsharded parameter); a shape
    mismatch is a ``ValueError`` naming both shapes."""
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def _param(*shape: int, dtype: torch.dtype | None, device: torch.device | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _load_rows(param: nn.Parameter, part: torch.Tensor, offset: int, size: int) -> None:
    target = param.data.narrow(0, offset, size)
    if target.shape != part.shape:
        raise ValueError(f"checkpoint slice has shape {tuple(part.shape)}, expected {tuple(target.shape)}")
    target.copy_(part)


class LinearBase(nn.Module):
    weight: nn.Parameter  # created by the quantization method, with any scales it needs
    _linear: LinearOp

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        kernels: KernelSet | None = None,
        quant: QuantMethod | None = None,
        quantize: bool = True,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        #: False: the layer keeps the model's dtype whatever the checkpoint's method (a MoE router).
        self.quantize = quantize
        self.dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.kernels = kernels or select_kernels(device, self.dtype)
        self._build((quant or UNQUANTIZED) if quantize else UNQUANTIZED, device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None
        if self.bias is not None:
            set_loader(self.bias, self.load_weight)

    def use_quant(self, quant: QuantMethod) -> None:
        """Re-create this layer's weight with ``quant`` (at build time, before loading)."""
        device = self.weight.device
        for name in [n for n in self._parameters if n != "bias"]:  # every name: a scale may have two
            delattr(self, name)  # the previous method's weight and scales
        self._build(quant, device)

    def _build(self, quant: QuantMethod, device: torch.device | None) -> None:
        self.quant = quant
        quant.create_weights(self, self.dtype, device)
        self._linear = quant.make_linear(self)
        #: How the op before this layer may quantize its input for it (None: it hands over a 16-bit tensor).
        self.fused_input: FusedInput | None = quant.fused_input(self)

    def part_rows(self, shard_id: Any = None) -> int:
        """Rows of the full checkpoint tensor that loads as ``shard_id`` (a scale's loader expands to them)."""
        return self.out_features

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        default_loader(param, loaded)

    def _load_parts(self, param: nn.Parameter, loaded: torch.Tensor, parts: dict[Any, int], what: str) -> None:
        """Load one checkpoint tensor holding every part of a fused weight (in order) part by part."""
        total = sum(parts.values())
        if loaded.shape[0] != total:
            raise ValueError(
                f"a fused weight of {what} got a tensor of shape {tuple(loaded.shape)} and no shard_id: give "
                f"either the whole fused tensor ({total} rows, parts in order) or each part with its shard_id "
                f"{', '.join(map(repr, parts))}; the model's stacked_params map checkpoint names to shard ids"
            )
        for shard_id, part in zip(parts, loaded.split(list(parts.values())), strict=True):
            self.load_weight(param, part, shard_id)

    def forward(self, x: LinearInput) -> torch.Tensor:
        return self._linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """The same full weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks (the output stays sharded); each block of ``output_sizes``
    (e.g. gate and up of a merged weight) is split separately."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool = False, *, tp: TPInfo = TPInfo(), **kw: Any
    ):
        self.tp = tp
        self.output_sizes = list(output_sizes)
        self.local_sizes = [tp.shard(s, "linear output size") for s in output_sizes]
        super().__init__(in_features, sum(self.local_sizes), bias, **kw)

    def part_rows(self, shard_id: Any = None) -> int:
        return sum(self.output_sizes) if shard_id is None else self.output_sizes[int(shard_id)]

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None and len(self.local_sizes) > 1:
            blocks = f"{len(self.output_sizes)} blocks {self.output_sizes}"
            return self._load_parts(param, loaded, dict(enumerate(self.output_sizes)), blocks)
        index = 0 if shard_id is None else int(shard_id)
        if not 0 <= index < len(self.local_sizes):
            raise ValueError(f"shard_id {shard_id!r} is out of range: this weight has {len(self.local_sizes)} blocks")
        size = self.local_sizes[index]
        _load_rows(param, loaded.narrow(0, self.tp.rank * size, size), sum(self.local_sizes[:index]), size)


class QKVParallelLinear(LinearBase):
    """Fused q/k/v projection, heads split across ranks; with fewer KV heads than ranks, rank ``r`` holds
    a copy of KV head ``r * num_kv_heads // tp.size``."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        *,
        tp: TPInfo = TPInfo(),
        **kw: Any,
    ):
        self.tp = tp
        self.head_dim = head_dim
        self.local_heads = tp.shard(num_heads, "number of attention heads")
        if num_kv_heads >= tp.size:
            self.local_kv_heads = tp.shard(num_kv_heads, "number of KV heads")
            self.kv_head_start = tp.rank * self.local_kv_heads
        elif tp.size % num_kv_heads:
            raise ValueError(f"tensor-parallel size {tp.size} is not a multiple of the KV head count {num_kv_heads}")
        else:
            self.local_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        q, kv = self.local_heads * head_dim, self.local_kv_heads * head_dim
        self.sizes = {"q": q, "k": kv, "v": kv}
        self.offsets = {"q": 0, "k": q, "v": q + kv}
        self.full_sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        super().__init__(hidden_size, q + 2 * kv, bias, **kw)

    def part_rows(self, shard_id: Any = None) -> int:
        return sum(self.full_sizes.values()) if shard_id is None else self.full_sizes[shard_id]

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            rows = ", ".join(f"{k} {n}" for k, n in self.full_sizes.items())
            return self._load_parts(param, loaded, self.full_sizes, f"q, k, v ({rows} rows)")
        if shard_id not in self.sizes:
            raise ValueError(f"QKV weight needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        size = self.sizes[shard_id]
        start = self.tp.rank * size if shard_id == "q" else self.kv_head_start * self.head_dim
        _load_rows(param, loaded.narrow(0, start, size), self.offsets[shard_id], size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed (all-reduce)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        tp: TPInfo = TPInfo(),
        comm: Communicator | None = None,
        **kw: Any,
    ):
        self.tp = tp
        self.comm = comm or SingleCommunicator()
        super().__init__(tp.shard(in_features, "linear input size"), out_features, bias, **kw)

    def _build(self, quant: QuantMethod, device: torch.device | None) -> None:
        super()._build(quant, device)
        # Until this torch build turns out to lack mm's out_dtype; a quantized weight has its own matmul.
        self._fp32_mm_ok = quant is UNQUANTIZED

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if param.dim() == 2:
            loaded = loaded.narrow(1, self.tp.rank * param.shape[1], param.shape[1])
        default_loader(param, loaded)

    def forward(self, x: LinearInput) -> torch.Tensor:
        if self.tp.size == 1:
            return self._linear(x, self.weight, self.bias)
        y = self._all_reduce_fp32(x) if isinstance(x, torch.Tensor) else None
        if y is None:
            plain = isinstance(x, torch.Tensor) and self.quant is UNQUANTIZED
            partial = F.linear(x, self.weight) if plain else self._linear(x, self.weight, None)  # type: ignore[arg-type]
            y = self.comm.all_reduce(partial)
        return y if self.bias is None else y + self.bias

    def _all_reduce_fp32(self, x: torch.Tensor) -> torch.Tensor | None:
        """The summed ``x @ weight.T`` with float32 partial sums, rounded once as a single-rank product is (bf16
        results then match tp=1 far more closely); None where ``mm``'s ``out_dtype`` is unavailable."""
        w = self.weight
        if not (self._fp32_mm_ok and w.is_cuda and w.dtype in (torch.bfloat16, torch.float16)):
            return None
        try:
            y = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            self._fp32_mm_ok = False  # this torch build lacks it: reduce in the activation dtype
            return None
        return self.comm.all_reduce(y.view(*x.shape[:-1], y.shape[-1])).to(x.dtype)
