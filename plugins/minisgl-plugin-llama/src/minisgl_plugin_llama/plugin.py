"""Entry module: declares the architectures; model code is imported only when built."""

from __future__ import annotations

from collections.abc import Iterable

from minisgl.plugins import ModelSpec, hookimpl


@hookimpl
def minisgl_models() -> Iterable[ModelSpec]:
    return [
        ModelSpec(name="LlamaForCausalLM", factory="minisgl_plugin_llama.llama:LlamaForCausalLM"),
        ModelSpec(name="MistralForCausalLM", factory="minisgl_plugin_llama.mistral:MistralForCausalLM"),
        ModelSpec(name="Qwen2ForCausalLM", factory="minisgl_plugin_llama.qwen2:Qwen2ForCausalLM"),
        ModelSpec(name="Qwen3ForCausalLM", factory="minisgl_plugin_llama.qwen3:Qwen3ForCausalLM"),
    ]
