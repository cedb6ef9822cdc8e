"""Llama-family models against transformers, token for token and logprob for logprob (float32, CPU).

Each class is the model conformance kit (docs/plugin-testing.md) for one architecture.
"""

from __future__ import annotations

from minisgl.testing.model_conformance import ModelConformance


class TestLlama(ModelConformance):
    architecture = "LlamaForCausalLM"
    provider = "llama"


class TestMistral(ModelConformance):
    architecture = "MistralForCausalLM"  # tiny settings: head_dim 16, no sliding window
    provider = "llama"


class TestQwen2(ModelConformance):
    architecture = "Qwen2ForCausalLM"  # q/k/v biases, tied embeddings
    provider = "llama"


class TestQwen3(ModelConformance):
    architecture = "Qwen3ForCausalLM"  # per-head q/k norm, head_dim 32
    provider = "llama"
