#!/usr/bin/env bash
# One call on the lent H200: install, check plugins, run the GPU tests and the offline
# benchmarks, profile. Results go to $OUT. Run from the repository root.
set -uo pipefail
export MAX_JOBS=16
LIMIT=${LIMIT:-400}
source docs/benchmarks/h200_setup.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee $OUT/log.txt
python3 -m minisgl plugins | tee -a $OUT/log.txt
B="python3 -m minisgl bench offline --output $OUT"
MODE=${1:-full}
step 200 $B --label offline-gpu --profile $OUT/profile.txt
if [ "$MODE" = full ]; then
  echo "=== GPU tests"
  timeout 220 python3 -m pytest -p no:cacheprovider -n 6 -q -rA core/tests/test_engine_gpu.py \
     plugins/minisgl-plugin-flashinfer/tests > $OUT/gpu-test-results.txt 2>&1; tail -n 25 $OUT/gpu-test-results.txt
fi
step 100 env MINISGL_DISABLE_TRITON=1 $B --label offline-gpu-torch-layers
step 120 env MINISGL_DISABLE_OVERLAP=1 $B --label offline-gpu-no-overlap
step 120 $B --cuda-graph-max-bs 0 --label offline-gpu-no-graphs
step 90 $B --latency --label offline-gpu-latency
ls -la $OUT
