"""Offline throughput benchmark, runnable from a checkout: ``python benchmarks/offline.py --workload cpu``.

The same program as ``minisgl bench offline``; it lives in the minisgl-bench package
(``pip install ./benchmarks/minisgl-bench``); see docs/benchmarks/ for the workloads and committed results.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from minisgl_bench.offline import main
except ModuleNotFoundError as exc:
    if exc.name != "minisgl_bench":
        raise
    sys.path.insert(0, str(Path(__file__).resolve().parent / "minisgl-bench" / "src"))  # not installed: the source
    from minisgl_bench.offline import main

if __name__ == "__main__":
    sys.exit(main())
