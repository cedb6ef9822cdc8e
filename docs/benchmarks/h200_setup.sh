#!/usr/bin/env bash
# Sourced by the run_*.sh scripts on a lent H200 host: installs the carried wheels into /tmp/site,
# puts the project's sources on PYTHONPATH and writes the dist-info metadata that makes the
# plugins' entry points visible (they are not pip-installed there). Defines `step LIMIT CMD...`.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/core/src:$PWD/plugins/minisgl-plugin-llama/src:$PWD/plugins/minisgl-plugin-flashinfer/src:$PWD/plugins/minisgl-plugin-qwen3-moe/src:$PWD/tests
python3 - <<'PY'
import pathlib
req = "Requires-Dist: minisgl<0.2,>=0.1\n"
dists = {"minisgl": ("builtin", "minisgl.plugins.builtin", ""),
         "minisgl_plugin_llama": ("llama", "minisgl_plugin_llama.plugin", req),
         "minisgl_plugin_qwen3_moe": ("qwen3-moe", "minisgl_plugin_qwen3_moe.plugin", req),
         "minisgl_plugin_flashinfer": ("flashinfer", "minisgl_plugin_flashinfer.plugin", req)}
for dist, (entry, module, r) in dists.items():
    d = pathlib.Path(f"/tmp/site/{dist}-0.1.0.dist-info"); d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: 0.1.0\n{r}")
    (d / "entry_points.txt").write_text(f"[minisgl]\n{entry} = {module}\n")
PY
LIMIT=${LIMIT:-560}
# Each step gets at most its own limit and never runs past the call's overall LIMIT (seconds).
step() { local t=$1; shift; local left=$((LIMIT - SECONDS)); [ $left -lt 30 ] && { echo "=== skipped: $*" | tee -a $OUT/log.txt; return; }
  [ $t -gt $left ] && t=$left; echo "=== $* (${t}s)" | tee -a $OUT/log.txt
  timeout "$t" "$@" 2>&1 | tee -a $OUT/log.txt | grep -v Warning | tail -n 14; }
