#!/usr/bin/env bash
# One call on a lent two-H200 host: every GPU test (core engine and kernels, flashinfer plugin,
# tensor parallelism over two GPUs). Results go to $OUT. Run from the repository root.
set -uo pipefail
source docs/benchmarks/h200_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a $OUT/log.txt
step 300 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -p no:cacheprovider -q -rA -s -n 4 core/tests/test_engine_gpu.py plugins/minisgl-plugin-flashinfer/tests plugins/minisgl-plugin-qwen3-moe/tests
step 200 python3 -m pytest -p no:cacheprovider -q -s -rA tests/test_tensor_parallel_gpu.py
grep -h "RESULT\|passed\|failed" $OUT/log.txt
