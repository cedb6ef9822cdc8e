"""Llama-family models (Llama, Mistral, Qwen2, Qwen3 dense) for minisgl."""
