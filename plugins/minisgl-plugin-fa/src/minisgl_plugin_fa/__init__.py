"""FlashAttention attention backends for minisgl (FlashAttention 2, 3 and 4, chosen per GPU)."""

__version__ = "0.2.0"
