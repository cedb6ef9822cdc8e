"""Tensor-parallel linear layers.

Every parameter carries a ``weight_loader(param, tensor, shard_id=None)`` that
copies this rank's slice of a full checkpoint tensor, so model files never deal
with sharding. ``shard_id`` selects a part of a fused weight ("q"/"k"/"v" or
the index of a merged column block). A fused weight also loads from one
checkpoint tensor that already holds every part, in order (``qkv_proj`` of
``[q; k; v]``, ``gate_up_proj`` of ``[gate; up]``, as Phi-3 stores them), given
with no ``shard_id``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import Communicator, SingleCommunicator, TPInfo
from ..kernel import KernelSet, select_kernels

WeightLoader = Callable[..., None]


def set_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def default_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def _param(*shape: int, dtype: torch.dtype | None, device: torch.device | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class LinearBase(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype | None,
        device: torch.device | None,
        kernels: KernelSet | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None
        set_loader(self.weight, self.load_weight)
        if self.bias is not None:
            set_loader(self.bias, self.load_weight)
        self.kernels = kernels or select_kernels(device, self.weight.dtype)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        default_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """The same full weight on every rank."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, *, dtype=None, device=None, kernels=None
    ):
        super().__init__(in_features, out_features, bias, dtype, device, kernels)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays sharded.

    ``output_sizes`` lists the blocks of a merged weight (e.g. gate and up);
    each block is split across ranks separately.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        *,
        tp: TPInfo = TPInfo(),
        dtype=None,
        device=None,
        kernels=None,
    ):
        self.tp = tp
        self.output_sizes = list(output_sizes)
        self.local_sizes = [tp.shard(s, "linear output size") for s in output_sizes]
        super().__init__(in_features, sum(self.local_sizes), bias, dtype, device, kernels)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None and len(self.local_sizes) > 1:
            # One checkpoint tensor holding every block, in order: load each block as if given alone.
            total = sum(self.output_sizes)
            if loaded.shape[0] != total:
                raise ValueError(
                    f"a merged column-parallel weight of {len(self.output_sizes)} blocks {self.output_sizes} "
                    f"got a tensor of shape {tuple(loaded.shape)} and no shard_id: give either the whole fused "
                    f"tensor ({total} rows, blocks in order) or each block with its shard_id "
                    f"0..{len(self.output_sizes) - 1} (the model's stacked_params map checkpoint names to shard ids)"
                )
            for index, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.load_weight(param, part, index)
            return
        index = 0 if shard_id is None else int(shard_id)
        if not 0 <= index < len(self.local_sizes):
            raise ValueError(f"shard_id {shard_id!r} is out of range: this weight has {len(self.local_sizes)} blocks")
        size = self.local_sizes[index]
        offset = sum(self.local_sizes[:index])
        part = loaded.narrow(0, self.tp.rank * size, size)
        default_loader_slice(param, part, offset, size)


class QKVParallelLinear(LinearBase):
    """Fused q/k/v projection with heads split across ranks.

    With fewer KV heads than ranks, KV heads are replicated: rank ``r`` holds
    KV head ``r * num_kv_heads // tp.size``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        *,
        tp: TPInfo = TPInfo(),
        dtype=None,
        device=None,
        kernels=None,
    ):
        self.tp = tp
        self.head_dim = head_dim
        self.local_heads = tp.shard(num_heads, "number of attention heads")
        if num_kv_heads >= tp.size:
            self.local_kv_heads = tp.shard(num_kv_heads, "number of KV heads")
            self.kv_head_start = tp.rank * self.local_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(
                    f"tensor-parallel size {tp.size} is not a multiple of the KV head count {num_kv_heads}"
                )
            self.local_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        q, kv = self.local_heads * head_dim, self.local_kv_heads * head_dim
        self.sizes = {"q": q, "k": kv, "v": kv}
        self.full_sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        super().__init__(hidden_size, q + 2 * kv, bias, dtype, device, kernels)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        full = self.full_sizes
        if shard_id is None:
            # One checkpoint tensor holding q, k and v, in that order: load each part as if given alone.
            total = sum(full.values())
            if loaded.shape[0] != total:
                raise ValueError(
                    f"a fused QKV weight (q {full['q']}, k {full['k']}, v {full['v']} rows) got a tensor of shape "
                    f"{tuple(loaded.shape)} and no shard_id: give either the whole fused tensor ({total} rows, "
                    "q then k then v) or q, k and v separately with shard_id 'q', 'k', 'v' "
                    "(the model's stacked_params map checkpoint names to shard ids)"
                )
            for sid, part in zip(full, loaded.split(list(full.values()), dim=0), strict=True):
                self.load_weight(param, part, sid)
            return
        if shard_id not in self.sizes:
            raise ValueError(f"QKV weight needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        size = self.sizes[shard_id]
        offset = {"q": 0, "k": self.sizes["q"], "v": self.sizes["q"] + self.sizes["k"]}[shard_id]
        if shard_id == "q":
            start = self.tp.rank * size
        else:
            start = self.kv_head_start * self.head_dim
        default_loader_slice(param, loaded.narrow(0, start, size), offset, size)


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
        dtype=None,
        device=None,
        kernels=None,
    ):
        self.tp = tp
        self.comm = comm or SingleCommunicator()
        self._fp32_mm_ok: bool | None = None  # probed on first use
        super().__init__(tp.shard(in_features, "linear input size"), out_features, bias, dtype, device, kernels)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if param.dim() == 2:
            size = param.shape[1]
            loaded = loaded.narrow(1, self.tp.rank * size, size)
        default_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.kernels.linear(x, self.weight, self.bias)
        partial = self._partial_fp32(x) if self._reduce_fp32 else None
        if partial is not None:
            # Partial sums stay float32 through the all-reduce and are rounded once, as a
            # single-rank product is: bf16 results then match tp=1 far more closely.
            y = self.comm.all_reduce(partial).to(x.dtype)
        else:
            y = self.comm.all_reduce(F.linear(x, self.weight))
        if self.bias is not None:
            y = y + self.bias
        return y

    @property
    def _reduce_fp32(self) -> bool:
        return self.weight.dtype in (torch.bfloat16, torch.float16) and self.weight.is_cuda

    def _partial_fp32(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x @ weight.T`` accumulated and returned in float32 (``mm`` with ``out_dtype``; CUDA only)."""
        if self._fp32_mm_ok is False:
            return None
        x2 = x.reshape(-1, x.shape[-1])
        try:
            y = torch.mm(x2, self.weight.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            self._fp32_mm_ok = False  # this torch build lacks it: reduce in the activation dtype
            return None
        self._fp32_mm_ok = True
        return y.view(*x.shape[:-1], y.shape[-1])


def default_loader_slice(param: nn.Parameter, part: torch.Tensor, offset: int, size: int) -> None:
    target = param.data.narrow(0, offset, size)
    if target.shape != part.shape:
        raise ValueError(f"checkpoint slice has shape {tuple(part.shape)}, expected {tuple(target.shape)}")
    target.copy_(part)
