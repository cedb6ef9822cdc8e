"""The model base class, model context and checkpoint loading."""

from .base import STACKED_PARAMS, CausalLM, DecoderLayer, ModelContext
from .loader import ModelLoadError, ModelSource, eos_token_ids, iter_weights, load_config, load_tokenizer

__all__ = [
    "STACKED_PARAMS",
    "CausalLM",
    "DecoderLayer",
    "ModelContext",
    "ModelLoadError",
    "ModelSource",
    "eos_token_ids",
    "iter_weights",
    "load_config",
    "load_tokenizer",
]
