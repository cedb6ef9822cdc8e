#!/usr/bin/env bash
# One call on a lent H200 host: kernel tests, FlashInfer decode variants, the offline benchmark and a
# profile window of it. Results go to $OUT. Run from the repository root.
set -uo pipefail
source docs/benchmarks/h200_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a $OUT/log.txt
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
step 150 python3 -m pytest -p no:cacheprovider -q -rA core/tests/test_engine_gpu.py -k "qk_norm or sampler or triton"
step 150 python3 docs/benchmarks/gpu_probe.py attention $OUT
step 150 python3 -m minisgl bench offline --output $OUT --label offline-gpu
step 150 python3 docs/benchmarks/gpu_probe.py window $OUT
ls -la $OUT
