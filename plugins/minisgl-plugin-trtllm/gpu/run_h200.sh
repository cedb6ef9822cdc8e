#!/usr/bin/env bash
# One call on a lent H200 (or any CUDA GPU): install, check, test and time minisgl-plugin-trtllm.
# Run from the repository root with .whl/ carried (../shared/gpu/wheels.sh fills it); results go to $OUT.
# Every step has its own time limit and a failed step does not stop the next one; the whole call stays
# under LIMIT seconds (590). Expected: about 4 minutes on a fresh machine, most of it compiling FlashInfer's modules.
set -uo pipefail
export LIMIT=${LIMIT:-590}
source benchmarks/h200/setup.sh  # wheels -> /tmp/site, PYTHONPATH, dist-info of the other packages, step()
HERE=plugins/minisgl-plugin-trtllm
export PYTHONPATH=$PYTHONPATH:$PWD/$HERE/src
python3 - <<'PY'
import pathlib
d = pathlib.Path("/tmp/site/minisgl_plugin_trtllm-0.1.0.dist-info"); d.mkdir(exist_ok=True)
(d / "METADATA").write_text("Metadata-Version: 2.1\nName: minisgl-plugin-trtllm\nVersion: 0.1.0\nRequires-Dist: minisgl<0.2,>=0.1\n")
(d / "entry_points.txt").write_text("[minisgl]\ntrtllm = minisgl_plugin_trtllm.plugin\n")
PY

nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv | tee -a $OUT/log.txt
step 60 python3 -c "import flashinfer, minisgl_plugin_trtllm.backend, minisgl_plugin_flashinfer.backend; print('import ok: flashinfer', flashinfer.__version__)"
step 60 python3 -m minisgl plugins --device cuda

# Compile ahead, in parallel: the XQA modules (one ninja run over 16 cores) and FlashInfer's own
# decode/prefill modules (for the comparison and the flashinfer,trtllm-xqa hybrid).
t0=$SECONDS
timeout 300 python3 $HERE/gpu/prebuild.py > $OUT/prebuild_xqa.log 2>&1 &
xqa_pid=$!
timeout 300 python3 $HERE/gpu/bench_decode.py --warmup-only > $OUT/prebuild_flashinfer.log 2>&1 &
fi_pid=$!
wait $xqa_pid; echo "=== prebuild xqa: exit $? after $((SECONDS - t0))s" | tee -a $OUT/log.txt
wait $fi_pid; echo "=== prebuild flashinfer: exit $? after $((SECONDS - t0))s" | tee -a $OUT/log.txt
tail -n 3 $OUT/prebuild_xqa.log $OUT/prebuild_flashinfer.log | tee -a $OUT/log.txt

# The CPU tests of the plugin run in CI; here only the file that needs the GPU and FlashInfer.
step 240 python3 -m pytest -p no:cacheprovider -q -rA -s --junitxml=$OUT/junit.xml $HERE/tests/test_trtllm_gpu.py
step 90 python3 $HERE/gpu/bench_decode.py --out $OUT/bench.json
echo "=== done in ${SECONDS}s" | tee -a $OUT/log.txt
grep -h "RESULT\|BENCH\|PREBUILD\|WARMUP\|FAILED\|ERROR\| passed\| failed\|=== " $OUT/log.txt | tail -n 80
