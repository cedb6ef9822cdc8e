#!/usr/bin/env bash
# One call on a lent two-H200 host: re-run of the GPU tests that failed in run_h200_tests.sh's run
# (teacher-forced agreement, hybrid/auto backends, the MoE tiny model) and the tp=2 agreement test.
set -uo pipefail
source docs/benchmarks/h200_setup.sh
LIMIT=280
step 150 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -p no:cacheprovider -q -rA -s -n 3 plugins/minisgl-plugin-qwen3-moe/tests/test_fused_cuda.py core/tests/test_engine_gpu.py -k "teacher or tiny_model or hybrid"
step 130 python3 -m pytest -p no:cacheprovider -q -s -rA tests/test_tensor_parallel_gpu.py
grep -h "RESULT\|passed\|failed" $OUT/log.txt
