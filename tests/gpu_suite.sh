#!/usr/bin/env bash
# The GPU suite on a lent H200 (docs/testing.md). Run from the repository root with the wheels of
# ../shared/gpu/wheels.sh carried in .whl/: does the setup of benchmarks/h200/setup.sh (the wheels,
# the project and every plugin on PYTHONPATH with their entry points), then tests/gpu_suite.py with
# the report in $OUT/gpu-suite/. LIMIT is the call's time limit in seconds (default 590); the suite
# gets what the setup leaves, less a margin to write the report. Arguments go to the runner.
set -uo pipefail
LIMIT=${LIMIT:-590}
OUT=${OUT:-/tmp/gpu-suite-out}
mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16}  # FlashInfer's JIT builds
source benchmarks/h200/setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m minisgl plugins
LEFT=$((LIMIT - SECONDS - 20))
python3 tests/gpu_suite.py --require-cuda --out "$OUT/gpu-suite" --jobs 2 \
  --total-timeout "$LEFT" --file-timeout $((LEFT < 420 ? LEFT : 420)) "$@"
