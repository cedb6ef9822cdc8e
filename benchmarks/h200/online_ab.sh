#!/usr/bin/env bash
# Online serving of this tree against earlier trees, one device call, same client: the protocol's online
# workload at RATES (default: Poisson 32 req/s), each tree's `minisgl serve` launched in turn (this tree first
# and last). Carry .whl and the trees as .ab-COMMIT (`git archive COMMIT core plugins` unpacked there); TREES
# names their commits. Results: $OUT/online-ab-LABEL-N.json, and each server's log beside it (its warnings:
# a full garbage collection over 50 ms is one).
set -uo pipefail
export LIMIT=${LIMIT:-560}
source benchmarks/h200/setup.sh
# The xgrammar library is not on the H200 (its plugin is, by folder); this workload sends no grammar.
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
RATES=${RATES:-32}
serve="python3 -m minisgl serve --model .peer/model --load-format dummy --max-model-len 4096 --port 30000 --log-level warning"
run() {  # LABEL ENV...: one sweep against a server launched with that environment
  local label=$1; shift
  step 150 python3 -m minisgl bench serve --tokenizer .peer/model --rate $RATES --warmup 16 --no-progress --keep-server-log \
    --output "$OUT" --label "online-ab-$label" --base-url http://127.0.0.1:30000 --launch-timeout 120 \
    --launch "env $* $serve"
}
run "${MINISGL_COMMIT:-new}-1" MINISGL_COMMIT=${MINISGL_COMMIT:-new}
for c in $TREES; do
  site=/tmp/site-$c path=/tmp/site-$c:/tmp/site:$PWD/.ab-$c/core/src
  for src in .ab-$c/plugins/minisgl-plugin-*/src; do path=$path:$PWD/$src; done
  python3 benchmarks/dist_info.py .ab-$c "$site"
  new_only=$(python3 benchmarks/dist_info.py --new-only .ab-$c)
  run "$c" PYTHONPATH=$path MINISGL_DISABLE_PLUGINS=${new_only:+$new_only,}$MINISGL_DISABLE_PLUGINS MINISGL_COMMIT=$c
done
run "${MINISGL_COMMIT:-new}-2" MINISGL_COMMIT=${MINISGL_COMMIT:-new}
echo "=== done in ${SECONDS}s" | tee -a "$OUT/log.txt"
