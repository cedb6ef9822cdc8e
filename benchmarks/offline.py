"""Offline throughput benchmark, runnable from a checkout: ``python benchmarks/offline.py --workload cpu``.

The same program as ``minisgl bench offline`` (it lives in ``minisgl.benchmark.offline`` so that an
installed engine can run it too); see docs/benchmarks/ for the workloads and committed results.
"""

from __future__ import annotations

import sys

from minisgl.benchmark.offline import main

if __name__ == "__main__":
    sys.exit(main())
