#!/usr/bin/env bash
# One call on a lent two-H200 host: kernel checks, the offline benchmark (docs/benchmarks/offline-gpu.md)
# twice from an empty Triton cache (no compilation may land inside the timed run), its ablations and
# decode latency, the tp=2 agreement test and the tensor-parallel benchmarks (docs/benchmarks/tp-h200x2.md).
# MINISGL_COMMIT names the commit under test. Results go to $OUT. Run from the repository root.
set -uo pipefail
export LIMIT=${LIMIT:-560}
source benchmarks/h200/setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a $OUT/log.txt
export TRITON_CACHE_DIR=/tmp/triton-fresh-$$
step 100 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -p no:cacheprovider -q -rA -s core/tests/test_engine_gpu.py -k "triton or qk_norm or sampler or teacher"
rm -rf $TRITON_CACHE_DIR
B="env CUDA_VISIBLE_DEVICES=0 python3 -m minisgl bench offline --output $OUT"
step 80 $B --label offline-gpu
step 80 $B --label offline-gpu-2
step 150 python3 -m pytest -p no:cacheprovider -q -s -rA tests/test_tensor_parallel_gpu.py
step 60 $B --no-overlap --label offline-gpu-no-overlap
step 60 $B --latency --label offline-gpu-latency
step 60 python3 -m minisgl bench offline --output $OUT --tp 2 --label offline-gpu-tp2
C=benchmarks/minisgl-bench/src/minisgl_bench/configs/qwen3-8b.json
step 70 $B --model-config $C --label offline-8b-tp1
step 70 python3 -m minisgl bench offline --output $OUT --model-config $C --tp 2 --label offline-8b-tp2
step 60 $B --cuda-graph-max-bs 0 --label offline-gpu-no-graphs
echo "=== done in ${SECONDS}s" | tee -a "$OUT/log.txt"
