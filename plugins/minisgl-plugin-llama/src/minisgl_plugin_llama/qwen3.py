"""Qwen3 (dense): Llama with per-head RMSNorm on q and k before rope."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
