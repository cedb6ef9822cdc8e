"""minisgl-bench: the benchmark programs of minisgl (``minisgl bench ...`` / ``minisgl-bench ...``).

Offline throughput, shared-prefix workloads and the online serving client, with its fake
server, launcher and plot. They use only minisgl's public modules.
"""
