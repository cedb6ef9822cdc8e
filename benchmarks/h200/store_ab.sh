#!/usr/bin/env bash
# One call on a lent GPU: the FP8 KV cache's store, one fused launch (KernelSet.store_kv_quantized of the triton
# set) against the reference path (quantize_kv, then the triton byte store: five launches), on the protocol's
# offline workload at SHAPE (default qwen3-8b) with FP8 weights + FP8 KV, ROUNDS (default 2) alternating rounds.
# Carry .whl. MINISGL_COMMIT names the commit. Results in $OUT: offline-*-fused-N.json, offline-*-unfused-N.json.
set -uo pipefail
export LIMIT=${LIMIT:-560}
source benchmarks/h200/setup.sh
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
SHAPE=${SHAPE:-qwen3-8b}
C8=benchmarks/minisgl-bench/src/minisgl_bench/configs/$SHAPE.json
args=$(variant_args fp8kv)
prebuild_variants fp8kv
POOL=core/src/minisgl/kvcache/pool.py
cp $POOL /tmp/pool.fused.py
# The unfused side: the pool calls the reference KernelSet's store_kv_quantized with the engine's kernel set.
sed -e 's/from ..kernel import select_kernels/from ..kernel import KernelSet, select_kernels/' \
    -e 's/self.kernels.store_kv_quantized(/KernelSet.store_kv_quantized(self.kernels, /' $POOL > /tmp/pool.unfused.py
grep -q "KernelSet.store_kv_quantized(self.kernels" /tmp/pool.unfused.py || { echo "unfused patch failed"; exit 1; }
for round in $(seq ${ROUNDS:-2}); do
  for side in fused unfused; do
    cp /tmp/pool.$side.py $POOL
    step 100 python3 -m minisgl bench offline --model-config $C8 --output $OUT $args --label offline-$SHAPE-fp8kv-store-$side-$round
  done
done
cp /tmp/pool.fused.py $POOL
echo "=== done in ${SECONDS}s" | tee -a "$OUT/log.txt"
