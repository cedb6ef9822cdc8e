#!/usr/bin/env bash
# FlashAttention 4 plugin on a lent H200, in two back-to-back calls (run from the repository root).
# The CuTe DSL compiler FlashAttention 4 needs is too big for one call's carry, so it travels in two
# parts (gpu/pack_wheels.sh makes them here, under the git-ignored plugins/minisgl-plugin-fa/build/):
#
#   stage  (carry .whl and plugins/minisgl-plugin-fa/build/gpu-a):
#          keeps the first part in /tmp/fa-stage, installs .whl into /tmp/site and compiles
#          FlashInfer's kernels for the benchmark and test shapes (cached in ~/.cache/flashinfer).
#   run    (carry plugins/minisgl-plugin-fa/build/gpu-b):
#          joins, checks and unpacks the DSL, installs FlashAttention 4, checks the import, runs the
#          kernel benchmark against FlashInfer and the plugin's GPU tests. Needs the stage call's /tmp
#          (a machine still warm from it).
#
# Every step runs under `timeout`, logs to $OUT/log.txt and never stops the script; the call as a
# whole stays under LIMIT seconds (default 540). Results: $OUT/log.txt, $OUT/fa_bench.json,
# $OUT/pytest-*.txt.
set -uo pipefail
mode=${1:-run}
OUT=${OUT:-/tmp/fa-out}
mkdir -p "$OUT"
LIMIT=${LIMIT:-540}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
here=plugins/minisgl-plugin-fa
stage=${FA_STAGE:-/tmp/fa-stage}
site=${SITE:-/tmp/site}
fa_site=${FA_SITE:-/tmp/site-fa}

log() { echo "$*" | tee -a "$OUT/log.txt"; }
# step LIMIT CMD...: at most LIMIT seconds, never past the call's LIMIT; output to the log, tail shown.
step() {
  local t=$1; shift; local left=$((LIMIT - SECONDS))
  if [ "$left" -lt 20 ]; then log "=== skipped (out of time): $*"; return 0; fi
  [ "$t" -gt "$left" ] && t=$left
  log "=== $* (limit ${t}s, at ${SECONDS}s)"
  timeout "$t" "$@" > "$OUT/step.txt" 2>&1; local rc=$?
  cat "$OUT/step.txt" >> "$OUT/log.txt"
  grep -v -i "warning\|warner\|exe_args\|return super" "$OUT/step.txt" | tail -n 25
  log "=== exit $rc after ${SECONDS}s"
  return 0
}

project_path() {
  # The project's sources and the dist-info that makes their entry points visible (nothing is pip-installed).
  export PYTHONPATH=$fa_site:$fa_site/nvidia_cutlass_dsl/dsl_packages:$site:$PWD/core/src
  for p in llama flashinfer qwen3-moe fa; do PYTHONPATH=$PYTHONPATH:$PWD/plugins/minisgl-plugin-$p/src; done
  SITE=$site python3 - <<'PY'
import os, pathlib
req = "Requires-Dist: minisgl<0.2,>=0.1\n"
dists = {"minisgl": ("builtin", "minisgl.plugins.builtin", ""),
         "minisgl_plugin_llama": ("llama", "minisgl_plugin_llama.plugin", req),
         "minisgl_plugin_qwen3_moe": ("qwen3-moe", "minisgl_plugin_qwen3_moe.plugin", req),
         "minisgl_plugin_flashinfer": ("flashinfer", "minisgl_plugin_flashinfer.plugin", req),
         "minisgl_plugin_fa": ("fa", "minisgl_plugin_fa.plugin", req)}
for dist, (entry, module, r) in dists.items():
    d = pathlib.Path(os.environ["SITE"]) / f"{dist}-0.1.0.dist-info"; d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: 0.1.0\n{r}")
    (d / "entry_points.txt").write_text(f"[minisgl]\n{entry} = {module}\n")
PY
}

install_whl() {
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $site .whl/*.whl 2>&1 \
      | grep -v "already exists\|Specify --upgrade" | tail -n 3
  fi
  python3 -c "import flashinfer, zmq, pydantic_settings" 2>/dev/null && log "serving stack and flashinfer: importable" \
    || log "WARNING: flashinfer or the serving stack is missing from $site (carry .whl)"
}

log "=== fa plugin on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), mode $mode, $(date -u +%FT%TZ)"
git rev-parse HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$OUT/log.txt"

if [ "$mode" = stage ]; then
  mkdir -p $stage && cp $here/build/gpu-a/cu13.part0 $stage/ && ls -l $stage | tee -a "$OUT/log.txt"
  install_whl
  project_path
  # FlashInfer compiles on first use (about a minute): head_dim 128, the benchmark's and the hybrid tests'.
  step 300 python3 $here/gpu/bench_kernels.py --backends flashinfer --warmup-only
  du -sh ~/.cache/flashinfer 2>/dev/null | tee -a "$OUT/log.txt"
  exit 0
fi

# ---------------------------------------------------------------- run
b=$here/build/gpu-b
if [ ! -s $stage/cu13.part0 ]; then
  log "ERROR: $stage/cu13.part0 is missing: run the stage call first, on the same warm machine"
else
  cat $stage/cu13.part0 $b/cu13.part[1-9] > $stage/cutlass-dsl-cu13-4.8.1.tar.xz
  (cd $stage && sha256sum -c "$OLDPWD/$b/SHA256SUMS") 2>&1 | tee -a "$OUT/log.txt"
  rm -rf $fa_site && mkdir -p $fa_site
  # The DSL ships as three wheels sharing one package folder: unpack them into one tree
  # (pip --target would skip the later ones), then the compiler from the tarball.
  for w in $b/*.whl; do python3 -m zipfile -e "$w" $fa_site; done
  python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
    $stage/cutlass-dsl-cu13-4.8.1.tar.xz $fa_site 2>&1 | tail -n 3
  if ! python3 -c "import cuda.bindings.driver" 2>/dev/null; then
    log "cuda-bindings missing: installing the carried fallback"
    for w in $b/fallback/*.whl; do python3 -m zipfile -e "$w" $fa_site; done
  fi
  du -sh $fa_site | tee -a "$OUT/log.txt"
fi
[ -d $site/flashinfer ] || install_whl
project_path
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa-cute-cache

step 120 python3 -c "
import time, importlib.metadata as md, torch
t = time.time(); import cutlass.cute, flash_attn.cute; t = time.time() - t
print('flash_attn.cute imported in %.1fs from %s' % (t, flash_attn.cute.__file__))
print({d: md.version(d) for d in ('flash-attn-4', 'nvidia-cutlass-dsl-libs-base', 'nvidia-cutlass-dsl-libs-core', 'quack-kernels')})
import cuda.bindings, tvm_ffi; print('cuda-bindings', md.version('cuda-bindings'), 'apache-tvm-ffi', md.version('apache-tvm-ffi'))
from minisgl.plugins import cuda_capabilities; from minisgl_plugin_fa.support import installed_generations, is_supported
print('generations', installed_generations(), 'gpus', cuda_capabilities(), 'fa supported:', is_supported('cuda'))
"
step 30 python3 -m minisgl plugins --device cuda
step 200 python3 $here/gpu/bench_kernels.py --backends fa,flashinfer --out "$OUT/fa_bench.json"
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
step 240 python3 -m pytest -p no:cacheprovider -q -rfEs $xdist $here/tests/test_fa_gpu.py -k "not greedy and not hybrid" \
  --junitxml="$OUT/pytest-kernels.xml"
step 200 python3 -m pytest -p no:cacheprovider -q -rfEs $xdist $here/tests/test_fa_gpu.py -k "greedy or hybrid" \
  --junitxml="$OUT/pytest-models.xml"
step 60 python3 -m pytest -p no:cacheprovider -q -rfEs $here/tests/test_fa_plugin.py
grep -h "passed\|failed\|^=== exit\|ERROR" "$OUT/log.txt" | tail -n 20
