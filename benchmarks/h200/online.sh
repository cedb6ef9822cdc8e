#!/usr/bin/env bash
# H200 session, call 2 of 3: minisgl serve against Mini-SGLang's own server, same client, same
# workload (bench/PROTOCOL.md "Online serving": 256 streamed chat requests, 16 to warm up, all at
# once then Poisson 32 and 8 req/s), then the offline workload for both. Carry .whl and .peer
# (../shared/bench/peer/setup.sh); MINISGL_COMMIT names the commit. Results: JSON files in $OUT.
# RATES (default "inf 32 8"), ORDER (default "peer minisgl") and OFFLINE=0 (skip the offline runs) vary it.
# One sweep is one draw: docs/benchmarks/h200-2026-12-01-final says how far runs of one tree spread.
set -uo pipefail
export LIMIT=${LIMIT:-520}
source benchmarks/h200/setup.sh
# The xgrammar library is not on the H200 (its plugin is, by folder); these workloads send no grammar.
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
use_peer
cat .peer/VERSION | tee -a "$OUT/log.txt"
BENCH="python3 -m minisgl bench serve --tokenizer .peer/model --rate ${RATES:-inf 32 8} --warmup 16 --no-progress --keep-server-log --output $OUT"
for system in ${ORDER:-peer minisgl}; do
  if [ $system = peer ]; then
    step 300 $BENCH --label online-peer --fallback-count max-tokens --base-url http://127.0.0.1:1919 --launch-timeout 240 --launch \
      "$PEER_ENV python3 -m minisgl --model-path .peer/model --dummy-weight --port 1919 --attention-backend fi --page-size 1 --cuda-graph-max-bs 256 --max-seq-len-override 4096"
  else
    step 200 $BENCH --label online-minisgl --base-url http://127.0.0.1:30000 --launch-timeout 180 --launch \
      "python3 -m minisgl serve --model .peer/model --load-format dummy --max-model-len 4096 --port 30000 --log-level warning"
  fi
done
if [ "${OFFLINE:-1}" != 0 ]; then
  step 70 python3 -m minisgl bench offline --output "$OUT" --label offline-minisgl
  step 70 $PEER_ENV python3 .peer/offline_peer.py 1
fi
echo "=== done in ${SECONDS}s" | tee -a "$OUT/log.txt"
