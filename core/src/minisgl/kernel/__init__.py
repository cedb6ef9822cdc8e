"""The kernels the layers call: :class:`KernelSet` is the plain PyTorch reference (the kernel set ``torch``).
Faster sets come from plugins (the ``kernels`` component kind): a subclass replaces the ops it has kernels for
and takes this PyTorch path for inputs its kernels do not handle, so a layer's forward is one call.
:func:`select_kernels` chooses one per engine."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ..plugins import PluginRegistry

QKNorm = tuple[torch.Tensor, torch.Tensor, float]  # (q weight, k weight, eps) of a per-head RMSNorm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, rounded to ``x``'s dtype before the weight (as Hugging Face models do)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one op, the same arithmetic
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fp32_reciprocal(scale: float) -> float:
    """``1 / scale`` as float32 computes it (IEEE division of float32 ``1`` by float32 ``scale``, rounded to
    nearest), a Python float that float32 holds exactly. The quotient of two floats computed in double and
    rounded once to float is the correctly rounded float quotient."""
    s = struct.unpack("f", struct.pack("f", scale))[0]
    return float(struct.unpack("f", struct.pack("f", 1.0 / s))[0])


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` (``x`` in float32 times :func:`fp32_reciprocal` of ``scale``, the same on every device),
    clamped to the range of ``dtype`` (a cast past it gives NaN), rounded to nearest even, in ``dtype``: what a
    quantized KV cache stores (also :func:`minisgl.kvcache.quantize_kv`)."""
    limit = torch.finfo(dtype).max
    y = x if scale == 1.0 else x.float() * fp32_reciprocal(scale)
    return y.clamp(-limit, limit).to(dtype)  # out of place: ``x`` is the caller's


def weight_major(rows: int) -> bool:
    """Whether CPU float32 :meth:`KernelSet.linear` computes ``(weight @ x.T).T``: faster on every
    shape measured at 2-8 and 16-256 rows, even at 10-15; one row is a matrix-vector product
    either way, and from a few hundred rows (prefill) ``F.linear`` is as fast or faster."""
    return 2 <= rows <= 256


class KernelSet:
    """The ops in plain PyTorch; subclasses replace them with kernels where those apply."""

    name = "torch"
    #: One-pass temperature sampling ``(logits, inv_temperature, seed) -> tokens``; None: not available.
    gumbel_sample: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None

    def __init__(self) -> None:
        # Every layer rotates by the same positions: rope factors are computed once per forward, keyed on
        # that positions tensor, its version (an in-place edit misses) and whether a CUDA graph is being
        # captured (factors computed by the warm-up run must not be baked into the graph as constants).
        self._rope_factors: tuple[Any, ...] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear``; on CPU float32 MKL's GEMM is slow for few rows of ``x`` (1.2-2.8x on AMD EPYC),
        so at 2-256 rows the weight is the left operand. Below 16 rows ``x`` and the result are made
        row-major (a column-major one slows this GEMM 2-3x and every row-wise op after it)."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.device.type != "cpu" or x.dtype != torch.float32 or not weight_major(rows):
            return F.linear(x, weight, bias)
        x2 = x.reshape(rows, x.shape[-1])
        if rows < 16:
            x2 = x2.contiguous()
        y = torch.mm(weight, x2.t()).t()
        if rows < 16:
            y = y.contiguous()
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], weight.shape[0])

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; with no residual yet, ``x`` starts it."""
        if residual is not None:
            x = x + residual
        return rms_norm(x, weight, eps), x

    def rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, qk_norm: QKNorm | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half rope of ``q`` ``[T, hq, d]`` and ``k`` ``[T, hkv, d]`` (each head RMS-normalised
        first with ``qk_norm``); ``cos_sin[pos]`` is ``d/2`` cosines then ``d/2`` sines."""
        if qk_norm is not None:
            q, k = rms_norm(q, qk_norm[0], qk_norm[2]), rms_norm(k, qk_norm[1], qk_norm[2])
        capturing = positions.is_cuda and torch.cuda.is_current_stream_capturing()
        cached = self._rope_factors
        if (
            cached is not None
            and cached[0] is positions
            and cached[1] == positions._version
            and cached[2] is cos_sin
            and cached[3] == capturing
        ):
            cos2, sin2 = cached[4], cached[5]
        else:
            cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
            cos2, sin2 = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
            self._rope_factors = (positions, positions._version, cos_sin, capturing, cos2, sin2)
        return _rotate(q, cos2, sin2), _rotate(k, cos2, sin2)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        """``k_cache[loc] = k; v_cache[loc] = v``: rows ``[T, heads, d]``, caches ``[slots, heads, d]``."""
        k_cache.index_copy_(0, loc, k.to(k_cache.dtype))
        v_cache.index_copy_(0, loc, v.to(v_cache.dtype))

    def store_kv_quantized(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        loc: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: float,
        v_scale: float,
    ) -> None:
        """The store of a quantized (float8) cache: ``k_cache[loc] = quantize_kv(k, k_scale, k_cache.dtype)``,
        and the same for ``v``. Here the rows are quantized first and stored as bytes through
        :meth:`store_kv` (not every device has an ``index_copy`` for float8); a kernel set may do both in one
        launch, with the same rounding (round to nearest even, after the clamp)."""
        kq = quantize_kv(k, k_scale, k_cache.dtype).view(torch.uint8)
        vq = quantize_kv(v, v_scale, v_cache.dtype).view(torch.uint8)
        self.store_kv(kq, vq, loc, k_cache.view(torch.uint8), v_cache.view(torch.uint8))

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)


def _rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]`` in three elementwise ops (``x.roll`` is ``[x2, x1]``)."""
    x32 = x.float()
    if x32.stride(-1) != 1:
        x32 = x32.contiguous()  # attention wants head_dim contiguous (SDPA on CPU is slow otherwise)
    return (x32 * cos2 + x32.roll(x.shape[-1] // 2, dims=-1) * sin2).to(x.dtype)


def torch_kernels(device: torch.device, dtype: torch.dtype) -> KernelSet:
    """The factory of the built-in kernel set ``torch``: any device and dtype."""
    return KernelSet()


def select_kernels(
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    choice: str = "auto",
    registry: PluginRegistry | None = None,
) -> KernelSet:
    """The kernel set for layers on ``device`` computing in ``dtype``. Without a ``registry``, the plain
    :class:`KernelSet`. With one, ``choice`` names a registered set, or ``"auto"``: the best ranked that
    runs on the device, skipping a set whose factory raises ``Unsupported`` for this dtype."""
    if registry is None:
        if choice not in ("auto", "torch"):
            raise ValueError(f"kernel set '{choice}' comes from a plugin: pass the plugin registry")
        return KernelSet()
    from ..plugins import UnknownComponentError, Unsupported

    dev = torch.device(device or "cpu")
    dtype = dtype or torch.get_default_dtype()
    specs = registry.ranked("kernels", dev.type) if choice == "auto" else [registry.pick("kernels", choice, dev.type)]
    for spec in specs:
        try:
            return spec.build(dev, dtype)  # type: ignore[no-any-return]
        except Unsupported as exc:
            if choice != "auto":
                raise UnknownComponentError(f"{spec.label} cannot run {dtype} on {dev.type}: {exc}") from None
    return KernelSet()
