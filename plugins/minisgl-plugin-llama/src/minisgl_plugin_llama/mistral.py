"""Mistral: the Llama layer stack; the context is capped at the sliding window."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @property
    def max_positions(self) -> int:
        # Full attention equals sliding-window attention up to the window: serve only that far.
        window = getattr(self.config, "sliding_window", None)
        return min(super().max_positions, window) if window else super().max_positions
