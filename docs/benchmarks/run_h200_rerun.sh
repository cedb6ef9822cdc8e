#!/usr/bin/env bash
# One call on a lent H200: the offline benchmark twice with the warm-up that shares no prompt with
# the timed run (d7eadb0), from an empty Triton cache, then the core's GPU engine tests (the linear
# layers and the LM head changed signature for the CPU kernels). Results go to $OUT.
set -uo pipefail
source docs/benchmarks/h200_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a $OUT/log.txt
export TRITON_CACHE_DIR=/tmp/triton-fresh-$$
B="python3 -m minisgl bench offline --output $OUT"
step 90 $B --label offline-gpu
step 80 $B --label offline-gpu-run2
step 240 python3 -m pytest -p no:cacheprovider -q -rfE core/tests/test_engine_gpu.py core/tests/test_engine_gpu_features.py
ls -la $OUT
