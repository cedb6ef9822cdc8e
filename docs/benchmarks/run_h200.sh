#!/usr/bin/env bash
# One call on the lent H200: install, check plugins, run the GPU tests and the offline
# benchmarks, profile. Results go to $OUT. Run from the repository root.
set -uo pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/core/src:$PWD/plugins/minisgl-plugin-llama/src:$PWD/plugins/minisgl-plugin-flashinfer/src
# Entry points exist only for installed distributions: write their metadata next to the wheels.
python3 - <<'PY'
import pathlib
dists = {"minisgl": ("builtin", "minisgl.plugins.builtin", ""),
         "minisgl_plugin_llama": ("llama", "minisgl_plugin_llama.plugin", "Requires-Dist: minisgl<0.2,>=0.1\n"),
         "minisgl_plugin_flashinfer": ("flashinfer", "minisgl_plugin_flashinfer.plugin", "Requires-Dist: minisgl<0.2,>=0.1\n")}
for dist, (entry, module, req) in dists.items():
    d = pathlib.Path(f"/tmp/site/{dist}-0.1.0.dist-info"); d.mkdir(exist_ok=True)
    name = dist.replace("_", "-")
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n{req}")
    (d / "entry_points.txt").write_text(f"[minisgl]\n{entry} = {module}\n")
PY
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee $OUT/log.txt
python3 -m minisgl plugins | tee -a $OUT/log.txt
B="python3 -m minisgl bench offline --output $OUT"
LIMIT=${LIMIT:-400}
# Each step gets at most its own limit and never runs past the call's overall LIMIT (seconds).
step() { local t=$1; shift; local left=$((LIMIT - SECONDS)); [ $left -lt 30 ] && { echo "=== skipped: $*"; return; }
  [ $t -gt $left ] && t=$left; echo "=== $* (${t}s)"; timeout "$t" "$@" 2>&1 | tee -a $OUT/log.txt | grep -v Warning | tail -n 14; }
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
