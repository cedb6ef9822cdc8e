"""Structured output for minisgl through xgrammar: the grammar backend ``xgrammar``."""
