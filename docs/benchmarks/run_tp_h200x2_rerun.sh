#!/usr/bin/env bash
# Second call on two lent H200s: the tp=2 vs tp=1 agreement test, and two more tp=1 offline runs.
set -uo pipefail
source docs/benchmarks/h200_setup.sh
timeout 200 python3 -m pytest -p no:cacheprovider -q -s -rA tests/test_tensor_parallel_gpu.py 2>&1 | tee $OUT/tp-gpu-test.txt | grep -E "RESULT|passed|failed|Error"
