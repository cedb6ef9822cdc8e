#!/usr/bin/env bash
# H200, one GPU: `minisgl serve --dp 2` (two replicas sharing the GPU, each with half of --mem-fraction) against
# --dp 1, with `minisgl bench serve` on the shared-prefix and random workloads; the two replicas once with the
# router's cache_aware policy and once with round_robin. Qwen3-0.6B with dummy weights (MODEL, default .peer/model,
# the model directory ../shared/bench/peer/setup.sh carries). Carry in .whl/ also the router's wheels:
# sglang_router-0.3.2-cp38-abi3-manylinux*_x86_64.whl and setproctitle (a wheel for the host's Python); setup.sh
# installs them with the others. Results: JSON files and server logs in $OUT. WORKLOADS (default
# "shared-prefix random") and RUNS (default "dp1 dp2-cache dp2-rr dp2-cache-bal") vary it; the six runs can pass one call's
# 10 minutes (start-ups), so run it as two calls: WORKLOADS=shared-prefix, then WORKLOADS=random.
# Carry only .whl and .peer/model: the working tree and the carried paths must fit in 64 MiB, and the router's
# wheel is 30 MB (leave nvidia_cudnn_frontend out of .whl for this call; none of these runs needs it).
set -uo pipefail
export LIMIT=${LIMIT:-560}
source benchmarks/h200/setup.sh
export MINISGL_DISABLE_PLUGINS=${MINISGL_DISABLE_PLUGINS-xgrammar}
python3 -c "import sglang_router, setproctitle; print('sglang-router', sglang_router.__version__)" | tee -a "$OUT/log.txt" \
  || { echo "sglang-router is not installed: carry its wheel (and setproctitle's) in .whl/" | tee -a "$OUT/log.txt"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee -a "$OUT/log.txt"
MODEL=${MODEL:-.peer/model}
SERVE="python3 -m minisgl serve --model $MODEL --load-format dummy --max-model-len 4096 --port 30000 --log-level warning"
BENCH="python3 -m minisgl bench serve --tokenizer $MODEL --base-url http://127.0.0.1:30000 --warmup 16 --no-progress --keep-server-log --output $OUT --launch-timeout 240"
for workload in ${WORKLOADS:-shared-prefix random}; do
  if [ "$workload" = shared-prefix ]; then
    args="--workload shared-prefix --num-requests 256 --turns 4 --system-len 2048 --concurrency 64"
  else
    args="--workload random --rate inf"
  fi
  for run in ${RUNS:-dp1 dp2-cache dp2-rr dp2-cache-bal}; do
    case $run in
      dp1) server="$SERVE" ;;
      dp2-cache) server="$SERVE --dp 2 --router-policy cache_aware" ;;
      dp2-rr) server="$SERVE --dp 2 --router-policy round_robin" ;;
      # cache_aware that balances early: with a shared system prompt the defaults send everything to one replica
      dp2-cache-bal) server="$SERVE --dp 2 --router-policy cache_aware --router-args '--balance-abs-threshold 4 --balance-rel-threshold 1.2'" ;;
    esac
    step 170 $BENCH $args --label "dp-$workload-$run" --launch "$server"
    # Nothing may outlive a run: a leftover replica would hold the next run's GPU memory.
    sleep 2; left=$(pgrep -f "minisgl serve|sglang_router.launch_router" || true)
    [ -n "$left" ] && { echo "=== left running after $run: $left" | tee -a "$OUT/log.txt"; kill -9 $left 2>/dev/null; }
  done
done
nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$OUT/log.txt"
echo "=== done in ${SECONDS}s" | tee -a "$OUT/log.txt"
