"""FP8 weights for minisgl: the quantization method ``fp8`` (docs in the README)."""
