"""Qwen2: Llama with biases on the q/k/v projections."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
