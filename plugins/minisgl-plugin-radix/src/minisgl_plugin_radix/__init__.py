"""Radix-tree prefix cache for minisgl (``--cache radix``)."""

__version__ = "0.2.0"
