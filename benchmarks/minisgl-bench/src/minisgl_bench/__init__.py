"""Benchmark programs (``minisgl bench ...``): offline throughput and serving load."""
