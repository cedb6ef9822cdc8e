"""Qwen3-MoE models and the ``fused`` (Triton) mixture-of-experts backend for minisgl."""
