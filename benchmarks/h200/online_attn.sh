#!/usr/bin/env bash
# H200 session, after fa.sh on the same warm machine (FlashAttention 4 unpacked in /tmp/site-fa):
# minisgl serve online with --attn fa, fa,flashinfer and flashinfer, side by side (all at once and
# Poisson 32 req/s, the protocol's online workload). Carry .whl and .peer. Results: JSON in $OUT.
set -uo pipefail
export LIMIT=${LIMIT:-330}
source benchmarks/h200/setup.sh > /dev/null 2>&1
export PYTHONPATH=/tmp/site-fa:/tmp/site-fa/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa-cute-cache
BENCH="python3 -m minisgl bench serve --tokenizer .peer/model --rate inf 32 --warmup 16 --no-progress --output $OUT"
for attn in fa,flashinfer fa flashinfer; do
  step 110 $BENCH --label "online-attn-${attn/,/-}" --launch-timeout 100 --launch \
    "python3 -m minisgl serve --model .peer/model --load-format dummy --max-model-len 4096 --port 30000 --log-level warning --attn $attn"
done
echo "=== done in ${SECONDS}s" | tee -a "$OUT/log.txt"
