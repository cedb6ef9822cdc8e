"""Which of the project's own plugin distributions provides a component name, so that an unknown name that
one of them would provide says what to install. Plain data, one table for every kind; nothing is imported."""

from __future__ import annotations

# kind -> component name or alias -> distribution. The "quantization" key is plain data: a kind the
# registry may not know yet is looked up by the same string.
FIRST_PARTY: dict[str, dict[str, str]] = {
    "attention": {
        "flashinfer": "minisgl-plugin-flashinfer",
        "fi": "minisgl-plugin-flashinfer",
        "fa": "minisgl-plugin-fa",
        "flash-attn": "minisgl-plugin-fa",
        "fa2": "minisgl-plugin-fa",
        "fa3": "minisgl-plugin-fa",
        "fa4": "minisgl-plugin-fa",
        "trtllm": "minisgl-plugin-trtllm",
        "trtllm-xqa": "minisgl-plugin-trtllm",
        "xqa": "minisgl-plugin-trtllm",
        "cpu": "minisgl-plugin-cpu",
    },
    "kernels": {"native": "minisgl-plugin-cpu", "triton": "minisgl-plugin-triton"},
    "prefix_cache": {"radix": "minisgl-plugin-radix"},
    "moe": {"fused": "minisgl-plugin-qwen3-moe"},
    "grammar": {"xgrammar": "minisgl-plugin-xgrammar"},
    "quantization": {"fp8": "minisgl-plugin-fp8"},
    "model": {
        "LlamaForCausalLM": "minisgl-plugin-llama",
        "MistralForCausalLM": "minisgl-plugin-llama",
        "Qwen2ForCausalLM": "minisgl-plugin-llama",
        "Qwen3ForCausalLM": "minisgl-plugin-llama",
        "Qwen3MoeForCausalLM": "minisgl-plugin-qwen3-moe",
    },
}


def install_hint(kind: str, name: str) -> str:
    """``"'flashinfer' is provided by minisgl-plugin-flashinfer: pip install minisgl-plugin-flashinfer"``, or
    ``""`` when no first-party plugin provides ``name``."""
    dist = FIRST_PARTY.get(kind, {}).get(name)
    return f"'{name}' is provided by {dist}: pip install {dist}" if dist else ""
