#!/usr/bin/env bash
# Second call on two lent H200s: the tp=2 vs tp=1 agreement test, and two more tp=1 offline runs.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/core/src:$PWD/plugins/minisgl-plugin-llama/src:$PWD/plugins/minisgl-plugin-flashinfer/src:$PWD/tests
python3 - <<'PY'
import pathlib
dists = {"minisgl": ("builtin", "minisgl.plugins.builtin", ""),
         "minisgl_plugin_llama": ("llama", "minisgl_plugin_llama.plugin", "Requires-Dist: minisgl<0.2,>=0.1\n"),
         "minisgl_plugin_flashinfer": ("flashinfer", "minisgl_plugin_flashinfer.plugin", "Requires-Dist: minisgl<0.2,>=0.1\n")}
for dist, (entry, module, req) in dists.items():
    d = pathlib.Path(f"/tmp/site/{dist}-0.1.0.dist-info"); d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: 0.1.0\n{req}")
    (d / "entry_points.txt").write_text(f"[minisgl]\n{entry} = {module}\n")
PY
timeout 200 python3 -m pytest -p no:cacheprovider -q -s -rA tests/test_tensor_parallel_gpu.py 2>&1 | tee $OUT/tp-gpu-test.txt | grep -E "RESULT|passed|failed|Error"
