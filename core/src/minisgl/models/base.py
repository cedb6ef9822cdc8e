"""The decoder-only model base class: an architecture file subclasses :class:`CausalLM` and builds one
decoder layer in :meth:`CausalLM.make_layer`, usually a :class:`DecoderLayer`."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..distributed import Communicator, SingleCommunicator, TPInfo
from ..kernel import KernelSet, select_kernels
from ..layers import ForwardContext, ParallelLMHead, RMSNorm, RotaryEmbedding, VocabParallelEmbedding, rope_parameters
from ..moe import BaseMoEBackend


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
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, shard = self.map_weight_name(name)
            if target not in params:
                close = difflib.get_close_matches(target, list(params), n=1, cutoff=0.8)
                raise KeyError(
                    f"checkpoint tensor '{name}' has no matching parameter in {type(self).__name__}"
                    + (f" (closest: '{close[0]}')" if close else "")
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
            loaded.add(target)
        expected = {n for n, _ in self.named_parameters()}
        if self.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise KeyError(f"checkpoint is missing weights for: {shown}")

    def map_weight_name(self, name: str) -> tuple[str, Any]:
        """Checkpoint name -> (parameter name, shard id or None)."""
        for fused, original, shard in self.stacked_params:
            if original in name:
                return name.replace(original, fused), shard
        return name, None
