"""How a linear layer stores and multiplies its weights: a :class:`QuantMethod`, one per engine, built by a
quantization plugin's factory (the ``quantization`` component kind, docs/plugin-contracts.md). The layer asks
its method once, at build time, to create its parameters (with their weight loaders) and for the matmul its
forward calls; the built-in :class:`Unquantized` method creates today's ``weight`` and returns the kernel set's
``linear``, so an unquantized layer's forward is the one call it always was. A mixture-of-experts layer's
stacked expert weights (:class:`~minisgl.moe.MoEExperts`) are created and finished by the same method
(:meth:`QuantMethod.create_expert_weights`, :meth:`QuantMethod.process_expert_weights_after_loading`).

A method whose matmul quantizes its input can also hand that quantization to the op before the layer
(:meth:`QuantMethod.fused_input`): the decoder layer's RMSNorms and the gated MLP's SiLU x up then write the
quantized activation (:class:`QuantizedActivation`) in the same kernel, instead of a 16-bit tensor that the matmul
reads again to quantize."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from .linear import LinearBase


@dataclass(frozen=True)
class QuantizedActivation:
    """A linear layer's input, already quantized by the op that produced it (:class:`FusedInput`): ``values``
    ``[tokens, K]`` in the method's storage dtype (float8_e4m3fn for FP8), ``scales`` ``[tokens, groups]`` float32
    (one group: a scale per token), ``dtype``: the activation dtype the values stand for (the matmul's output
    dtype). ``values * scales`` (each scale repeated over its group's columns) is the activation."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def tokens(self) -> int:
        return self.values.shape[0]

    def dequantize(self) -> torch.Tensor:
        """The activation in ``dtype`` (for a matmul that takes no quantized input)."""
        groups = self.scales.shape[-1]
        v = self.values.float().unflatten(-1, (groups, -1))
        return (v * self.scales.unsqueeze(-1)).flatten(-2).to(self.dtype)


#: What a linear layer's matmul takes: the activation, or that activation quantized by a fused producer.
LinearInput = torch.Tensor | QuantizedActivation
#: ``(x, weight, bias) -> y``: what a linear layer's forward calls, chosen once per layer. ``x`` is a
#: :class:`QuantizedActivation` only where the layer's method offered a :class:`FusedInput` that accepted its size.
LinearOp = Callable[[LinearInput, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class FusedInput:
    """Ops that compute what feeds a linear layer and quantize it as that layer's matmul would, in one kernel.

    - ``add_rmsnorm(x, residual, weight, eps) -> (input, x + residual)``: the kernel set's ``add_rmsnorm``
      (``residual`` None: ``x`` starts the residual), its first output quantized;
    - ``silu_mul(gate_up) -> input``: the kernel set's ``silu_mul``, quantized;
    - ``takes(tokens)``: whether the layer's matmul wants a quantized input at that token count (a method whose
      choice of kernel depends on the size may run one that takes 16-bit activations); where it is False, or
      an op is None, the producer runs the kernel set's op and the matmul gets the 16-bit tensor.

    The ops must produce exactly the values the unfused pair would: the kernel set's rounding, then the matmul's
    own quantization of that tensor.
    """

    add_rmsnorm: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], tuple[Any, torch.Tensor]] | None
    silu_mul: Callable[[torch.Tensor], Any] | None
    takes: Callable[[int], bool]

    def rmsnorm_op(self, tokens: int) -> Callable[..., tuple[Any, torch.Tensor]] | None:
        return self.add_rmsnorm if self.add_rmsnorm is not None and self.takes(tokens) else None

    def silu_mul_op(self, tokens: int) -> Callable[[torch.Tensor], Any] | None:
        return self.silu_mul if self.silu_mul is not None and self.takes(tokens) else None


class ExpertWeights(Protocol):
    """What a quantization method sees of a mixture-of-experts layer (:class:`minisgl.moe.MoEExperts`): its sizes
    (``local_inter``: this rank's share of ``intermediate_size``), the weights it creates there and the loader
    that slices a checkpoint tensor into them."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    local_inter: int
    w13_weight: nn.Parameter
    w2_weight: nn.Parameter

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None: ...


def new_param(*shape: int, dtype: torch.dtype | None, device: torch.device | None) -> nn.Parameter:
    """An uninitialised, frozen parameter."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class QuantMethod:
    """The weights of every linear layer of one engine: their parameters, loaders and matmul.

    A subclass overrides :meth:`create_weights` (register ``layer.weight`` and any scale tensors, each with a
    ``weight_loader``; the layer adds ``bias`` itself), :meth:`make_linear` (the matmul the layer's forward
    calls), and where needed :meth:`process_weights_after_loading` (repack or de-quantize once every tensor is
    in) and :meth:`for_layer` (layers the checkpoint left unquantized). ``name`` is how messages name it.
    """

    name = "none"
    #: Whether mixture-of-experts models can use this method: their experts are not linear layers, and a method
    #: that quantizes them overrides :meth:`create_expert_weights` (the default keeps them in the model's dtype).
    supports_moe = True

    def create_weights(self, layer: LinearBase, dtype: torch.dtype | None, device: torch.device | None) -> None:
        """Register ``layer.weight`` ``[out, in]`` in ``dtype``, loaded by the layer's ``load_weight`` (which
        slices this rank's rows or columns of the full checkpoint tensor)."""
        layer.weight = new_param(layer.out_features, layer.in_features, dtype=dtype, device=device)
        layer.weight.weight_loader = layer.load_weight  # type: ignore[attr-defined]

    def make_linear(self, layer: LinearBase) -> LinearOp:
        """The layer's matmul ``(x, weight, bias) -> y``, chosen once; it may read ``layer``'s other tensors."""
        return layer.kernels.linear  # type: ignore[return-value]  # no fused_input: x is always a tensor

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Called once per layer after the last checkpoint tensor (or dummy weights) is in."""

    def fused_input(self, layer: LinearBase) -> FusedInput | None:
        """Ops that let the norm or activation before ``layer`` quantize its input in their own kernel (asked
        once, when the layer is built; the ops may read what loading sets later). None (the default): the
        producers write 16-bit tensors and the matmul does what it does with them. A method returning ops makes
        its matmul accept their :class:`QuantizedActivation`."""
        return None

    def for_layer(self, checkpoint_names: Sequence[str]) -> QuantMethod:
        """The method of the layer holding the checkpoint modules ``checkpoint_names`` (a fused layer holds
        several: ``...q_proj``, ``...k_proj``, ``...v_proj``; a layer's experts hold ``...experts.<e>.gate_proj``,
        ``up_proj`` and ``down_proj`` of every expert): this one, or :data:`UNQUANTIZED` for layers the checkpoint
        did not quantize. Raise ``ValueError`` when only some of the parts are quantized."""
        return self

    def create_expert_weights(
        self, experts: ExpertWeights, dtype: torch.dtype | None, device: torch.device | None
    ) -> None:
        """Register ``experts.w13_weight`` ``[experts, 2 * inter, hidden]`` and ``experts.w2_weight`` ``[experts,
        hidden, inter]`` (``inter``: this rank's share) and any scale tensors, each with a ``weight_loader``
        (``experts.load_weight`` slices this rank's part of a per-expert or fused checkpoint tensor). The default
        keeps them in ``dtype``."""
        e, n, hidden = experts.num_experts, experts.local_inter, experts.hidden_size
        experts.w13_weight = new_param(e, 2 * n, hidden, dtype=dtype, device=device)
        experts.w2_weight = new_param(e, hidden, n, dtype=dtype, device=device)
        for param in (experts.w13_weight, experts.w2_weight):
            param.weight_loader = experts.load_weight  # type: ignore[attr-defined]

    def process_expert_weights_after_loading(self, experts: ExpertWeights) -> None:
        """Called once per expert layer after the last checkpoint tensor (or dummy weights) is in; a method that
        keeps quantized weights sets ``experts.scales`` (:class:`~minisgl.moe.ExpertScales`) here, for a backend
        whose ``expert_dtypes`` lists the weights' dtype."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Unquantized(QuantMethod):
    """Weights in the model's dtype, multiplied by the kernel set's ``linear``: the built-in method ``none``."""


#: The one unquantized method (it holds no state).
UNQUANTIZED = Unquantized()


def unquantized(config: dict[str, Any] | None, dtype: torch.dtype, device: torch.device) -> QuantMethod:
    """The factory of the built-in method ``none``."""
    if config is not None:
        raise ValueError(f"the method 'none' cannot load a quantized checkpoint (quantization_config {config})")
    return UNQUANTIZED
