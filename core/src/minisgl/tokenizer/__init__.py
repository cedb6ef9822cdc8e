"""The tokenizer/detokenizer worker: text to token ids and back, between the API server and the scheduler."""

from .detokenize import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer"]
