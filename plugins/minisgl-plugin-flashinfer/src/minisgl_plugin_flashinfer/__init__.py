"""FlashInfer attention backend for minisgl."""

__version__ = "0.2.0"
