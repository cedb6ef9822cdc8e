#!/usr/bin/env bash
# One call on a lent H200 host: kernel and FlashInfer tests, the offline benchmark and profile windows
# of it (mid-run and tail). Results go to $OUT. Run from the repository root.
set -uo pipefail
source docs/benchmarks/h200_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a $OUT/log.txt
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
step 200 python3 -m pytest -p no:cacheprovider -q -rA -n 4 core/tests/test_engine_gpu.py plugins/minisgl-plugin-flashinfer/tests
step 150 python3 -m minisgl bench offline --output $OUT --label offline-gpu
step 150 python3 docs/benchmarks/gpu_probe.py window $OUT 300
step 150 python3 docs/benchmarks/gpu_probe.py window $OUT 900
ls -la $OUT
