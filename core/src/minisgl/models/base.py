"""The decoder-only model base class: an architecture file subclasses :class:`CausalLM` and builds one
decoder layer in :meth:`CausalLM.make_layer`, usually a :class:`DecoderLayer`."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..distributed import Communicator, SingleCommunicator, TPInfo
from ..kernel import KernelSet, select_kernels
from ..layers import (
    AttentionBlock,
    ForwardContext,
    GatedMLP,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    rope_parameters,
)
from ..layers.linear import LinearBase
from ..layers.quant import UNQUANTIZED, QuantMethod
from ..moe import BaseMoEBackend, MoEExperts


@dataclass(frozen=True)
class ModelContext:
    """Everything a model factory is built from."""

    config: Any  # a transformers PretrainedConfig
    dtype: torch.dtype
    device: torch.device
    tp: TPInfo = TPInfo()
    comm: Communicator = SingleCommunicator()
    moe_backend: BaseMoEBackend | None = None
    kernels: KernelSet | None = None  # None: the PyTorch reference KernelSet
    quant: QuantMethod = UNQUANTIZED  # how linear layers hold their weights (pass it to every linear layer)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    ``self_attn`` is called as ``self_attn(positions, x, ctx)`` (an :class:`~minisgl.layers.AttentionBlock`),
    ``mlp`` as ``mlp(x)`` (a :class:`~minisgl.layers.GatedMLP`). Both norms are :class:`~minisgl.layers.RMSNorm`
    with ``norm_offset`` (``1.0`` for Gemma's ``1 + weight``; pass :attr:`CausalLM.norm_offset`); ``kw``: the
    norms' ``dtype``, ``device`` and ``kernels``.
    """

    def __init__(
        self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, *, norm_offset: float = 0.0, **kw: Any
    ):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, offset=norm_offset, **kw)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, offset=norm_offset, **kw)
        # The core's blocks read their input only through their first projection, so its quantization method
        # may quantize the norm's output in the norm's kernel (a plugin's own block keeps 16-bit inputs).
        if isinstance(self_attn, AttentionBlock):
            self.input_layernorm.feeds(self_attn.qkv_proj)
        if isinstance(mlp, GatedMLP):
            self.post_attention_layernorm.feeds(mlp.gate_up_proj)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm.forward_with_residual(x, residual)
        return self.mlp(x), residual


# Checkpoint names fused into one parameter here: (fused, original, shard id). A checkpoint storing the fused
# tensor (Phi-3's qkv_proj, gate_up_proj) needs no entry: the parameter's loader splits it.
STACKED_PARAMS: tuple[tuple[str, str, Any], ...] = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


# Per-tensor attention scales of FP8-calibrated checkpoints (vLLM, compressed-tensors, ModelOpt names): which of
# the KV cache's scales each sets. Query and softmax scales are accepted and unused (attention runs in the model
# dtype); none of them is a parameter.
_KV_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?"
    r"(k_scale|v_scale|kv_scale|q_scale|prob_scale|[kvq]_proj\.output_scale)$"
)


class _Backbone(nn.Module):
    def __init__(self, embed: nn.Module, layers: nn.ModuleList, norm: RMSNorm):
        super().__init__()
        self.embed_tokens = embed
        self.layers = layers
        self.norm = norm


class CausalLM(nn.Module):
    """A decoder-only causal LM over the paged KV cache; parameter names follow Hugging Face checkpoints
    (``model.layers.0...``, ``lm_head.weight``), so :meth:`load_weights` needs no per-model table.

    What architectures differ in, without rewriting :meth:`forward` (docs/model-plugin-tutorial.md):
    :meth:`make_layer` (the decoder layer), :attr:`norm_offset` (the norm variant), :meth:`embedding_scale` (a
    factor on the input embedding), :attr:`stacked_params` and :meth:`map_weight_name` (checkpoint names). The
    output embedding is tied to the input one when the config's ``tie_word_embeddings`` says so.
    """

    stacked_params: tuple[tuple[str, str, Any], ...] = STACKED_PARAMS
    #: Every :class:`~minisgl.layers.RMSNorm` computes ``x / rms(x) * (norm_offset + weight)``: ``0.0`` (Llama),
    #: ``1.0`` (Gemma). Used for the final norm; pass it to :class:`DecoderLayer` (``norm_offset=``) and
    #: :class:`~minisgl.layers.AttentionBlock` (``norm_offset=``, for q/k norms) in :meth:`make_layer`.
    norm_offset: float = 0.0

    def __init__(self, ctx: ModelContext):
        super().__init__()
        if ctx.kernels is None:  # chosen once here, so that make_layer passes ctx.kernels to every layer
            ctx = replace(ctx, kernels=select_kernels(ctx.device, ctx.dtype))
        cfg = ctx.config
        self.ctx, self.config = ctx, cfg
        kw: dict[str, Any] = {"dtype": ctx.dtype, "device": ctx.device, "kernels": ctx.kernels}
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = rope_parameters(cfg)
        self.rotary = RotaryEmbedding(head_dim, self.max_positions, rope, device=ctx.device, kernels=ctx.kernels)
        embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=ctx.tp, comm=ctx.comm, **kw)
        layers = nn.ModuleList(self.make_layer(i) for i in range(cfg.num_hidden_layers))
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=self.norm_offset, **kw)
        self.model = _Backbone(embed, layers, norm)
        # Rounded to the model's dtype, as the checkpoints' own code multiplies; 1.0 costs nothing per step.
        self.embed_scale = float(torch.tensor(float(self.embedding_scale()), dtype=ctx.dtype).item())
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=ctx.tp, comm=ctx.comm, **kw)
        if self.tie_word_embeddings:
            self.lm_head.weight = embed.weight
        # Layer -> {"k": scale, "v": scale} from the checkpoint (read by kv_cache_scales).
        self.kv_scales_loaded: dict[int, dict[str, float]] = {}
        if ctx.quant is not UNQUANTIZED:
            self._quantize_layers(ctx.quant)

    def _quantize_layers(self, quant: QuantMethod) -> None:
        """Give each linear layer and each layer's experts the method its checkpoint modules ask for (some stay
        unquantized)."""
        for name, layer in self.named_modules():
            if isinstance(layer, LinearBase):
                if not layer.quantize:
                    continue
                method = quant.for_layer(self.checkpoint_modules(name))
            elif isinstance(layer, MoEExperts):
                method = quant.for_layer(layer.checkpoint_modules(name))
            else:
                continue
            if method is not layer.quant:
                layer.use_quant(method)

    def checkpoint_modules(self, name: str) -> list[str]:
        """The checkpoint's module names that layer ``name`` holds (``...qkv_proj`` holds q_proj, k_proj, v_proj)."""
        dotted = f".{name}."
        parts = [dotted.replace(fused, original)[1:-1] for fused, original, _ in self.stacked_params if fused in dotted]
        return parts or [name]

    def process_weights_after_loading(self) -> None:
        """Let each linear layer's (and each layer's experts') quantization method finish its weights (repack,
        de-quantize)."""
        for layer in self.modules():
            if isinstance(layer, LinearBase):
                layer.quant.process_weights_after_loading(layer)
            elif isinstance(layer, MoEExperts):
                layer.quant.process_expert_weights_after_loading(layer)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 4096))

    def make_layer(self, layer_id: int) -> nn.Module:
        """Build decoder layer ``layer_id``; architecture files override this. Called from ``__init__`` after
        ``self.ctx``, ``self.config`` and ``self.rotary`` are set, before the embedding and final norm exist."""
        raise NotImplementedError

    def embedding_scale(self) -> float:
        """The factor the input embedding is multiplied by: ``1.0`` (no multiply at all); Gemma returns
        ``self.config.hidden_size ** 0.5``. Called once, in ``__init__``."""
        return 1.0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states ``[tokens, hidden]`` after the final norm."""
        hidden = self.model.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            hidden = hidden * self.embed_scale
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        hidden, _ = self.model.norm.forward_with_residual(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits for the given hidden states."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into this rank's parameters; error on anything missing."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[int] = set()  # ids of the parameters loaded (one registered under two names loads by either)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if (scale := _KV_SCALE_NAME.search(name)) is not None:
                self._load_kv_scale(name, int(scale.group(1)), scale.group(2), tensor)
                continue
            target, shard = self.map_weight_name(name)
            if target not in params:
                close = difflib.get_close_matches(target, list(params), n=1, cutoff=0.8)
                raise KeyError(
                    f"checkpoint tensor '{name}' has no matching parameter in {type(self).__name__}"
                    + (f" (closest: '{close[0]}')" if close else "")
                    + self._quantized_hint()
                    + "; if the checkpoint names a fused weight differently, map it in the model's "
                    "stacked_params or map_weight_name (docs/plugin-contracts.md, section Model)"
                )
            param = params[target]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                raise KeyError(f"parameter '{target}' has no weight loader")
            try:
                loader(param, tensor.to(param.dtype), *(() if shard is None else (shard,)))
            except (ValueError, RuntimeError) as exc:
                via = f" as shard {shard!r}" if shard is not None else ""
                raise ValueError(
                    f"checkpoint tensor '{name}' {tuple(tensor.shape)} does not load into parameter "
                    f"'{target}' {tuple(param.shape)}{via} of {type(self).__name__}: {exc}"
                ) from exc
            loaded.add(id(param))
        expected = {n: p for n, p in self.named_parameters()}
        if self.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
        missing = sorted(n for n, p in expected.items() if id(p) not in loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise KeyError(f"checkpoint is missing weights for: {shown}{self._quantized_hint()}")
        self.process_weights_after_loading()

    def _quantized_hint(self) -> str:
        qc = getattr(self.config, "quantization_config", None)
        if not qc:
            return ""
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else getattr(qc, "quant_method", "?")
        return (
            f"; the checkpoint is quantized (quantization_config.quant_method '{method}', loaded with the "
            f"quantization method '{self.ctx.quant.name}'): its scales load only into minisgl's linear layers "
            "(LinearBase), which take them from that method (docs/plugin-contracts.md, section Quantization)"
        )

    def _load_kv_scale(self, name: str, layer: int, kind: str, tensor: torch.Tensor) -> None:
        which = kind.split("_", 1)[0].split(".", 1)[0]  # k_scale / k_proj.output_scale -> k; kv_scale -> kv
        if which not in ("k", "v", "kv"):
            return  # q_scale, prob_scale, q_proj.output_scale
        if tensor.numel() != 1:
            raise ValueError(
                f"checkpoint tensor '{name}' {tuple(tensor.shape)} is not a per-tensor scale: the KV cache "
                "takes one k and one v scale per layer"
            )
        value = float(tensor.float().reshape(()))
        if not (0.0 < value < float("inf")):
            raise ValueError(f"checkpoint tensor '{name}' is {value}: a KV cache scale must be positive and finite")
        scales = self.kv_scales_loaded.setdefault(layer, {})
        for key in ("k", "v") if which == "kv" else (which,):
            scales[key] = value

    def kv_cache_scales(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per-layer ``(k scales, v scales)`` for a quantized KV cache: the checkpoint's, 1.0 where it has
        none; ``((), ())`` when it has none at all."""
        if not self.kv_scales_loaded:
            return (), ()
        layers = range(int(self.config.num_hidden_layers))
        k = tuple(self.kv_scales_loaded.get(i, {}).get("k", 1.0) for i in layers)
        return k, tuple(self.kv_scales_loaded.get(i, {}).get("v", 1.0) for i in layers)

    def map_weight_name(self, name: str) -> tuple[str, Any]:
        """Checkpoint name -> (parameter name, shard id or None)."""
        for fused, original, shard in self.stacked_params:
            if original in name:
                return name.replace(original, fused), shard
        return name, None
