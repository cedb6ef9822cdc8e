"""FlashInfer attention backend for minisgl."""

__version__ = "0.1.0"
