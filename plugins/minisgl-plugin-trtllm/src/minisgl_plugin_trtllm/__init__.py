"""TensorRT-LLM attention kernels (through FlashInfer) for minisgl."""

__version__ = "0.2.0"
