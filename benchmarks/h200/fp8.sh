#!/usr/bin/env bash
# One call on a lent H200: the protocol's offline workload at the sizes users serve (Qwen3-8B and Llama-3.1-8B
# shapes, dummy weights) in bf16, FP8 weights (--quantization fp8) and FP8 weights + FP8 KV
# (--kv-cache-dtype fp8_e4m3), against Mini-SGLang bf16 on the same shapes, and Qwen3-0.6B bf16 for both.
# Carry .whl and .peer (../shared/bench/peer/setup.sh). MINISGL_COMMIT names the commit. Results in $OUT
# (the peer's lines in log.txt: it prints one JSON line per run).
set -uo pipefail
export LIMIT=${LIMIT:-570}
source benchmarks/h200/setup.sh
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
use_peer
CONFIGS=benchmarks/minisgl-bench/src/minisgl_bench/configs
for shape in qwen3-8b llama-3.1-8b; do  # the peer reads a model folder: this shape's config and the tokenizer
  mkdir -p /tmp/peer-$shape && cp .peer/model/* /tmp/peer-$shape/ && cp $CONFIGS/$shape.json /tmp/peer-$shape/config.json
done
B="python3 -m minisgl bench offline --output $OUT"
C8=$CONFIGS/qwen3-8b.json CL=$CONFIGS/llama-3.1-8b.json
# In order of need: the call's LIMIT skips what no longer fits (the log names each skipped step).
step 90 $B --model-config $C8 --label offline-qwen3-8b-bf16
step 90 $B --model-config $C8 --quantization fp8 --label offline-qwen3-8b-fp8
step 90 $B --model-config $C8 --quantization fp8 --kv-cache-dtype fp8_e4m3 --label offline-qwen3-8b-fp8-kvfp8
step 120 $PEER_ENV python3 .peer/offline_peer.py 1 /tmp/peer-qwen3-8b
step 90 $B --model-config $CL --label offline-llama-3.1-8b-bf16
step 90 $B --model-config $CL --quantization fp8 --label offline-llama-3.1-8b-fp8
step 90 $B --model-config $CL --quantization fp8 --kv-cache-dtype fp8_e4m3 --label offline-llama-3.1-8b-fp8-kvfp8
step 120 $PEER_ENV python3 .peer/offline_peer.py 1 /tmp/peer-llama-3.1-8b
step 60 $B --label offline-qwen3-0.6b-bf16
step 90 $PEER_ENV python3 .peer/offline_peer.py 1
echo "=== done in ${SECONDS}s" | tee -a "$OUT/log.txt"
