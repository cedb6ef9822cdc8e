set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
[ -d /tmp/site/flashinfer ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/core/src:$PWD/plugins/minisgl-plugin-llama/src:$PWD/plugins/minisgl-plugin-flashinfer/src:$PWD/tests
ls /tmp/site | grep -c dist-info
timeout 200 python3 -m pytest -p no:cacheprovider -q -s -rA tests/test_tensor_parallel_gpu.py 2>&1 | tee $OUT/tp-gpu-test.txt | grep -E "RESULT|passed|failed|Error" 
timeout 120 python3 -m minisgl bench offline --output $OUT --label offline-gpu-storekv-rep2 2>&1 | grep -E "minisgl  |vs Mini"
timeout 120 python3 -m minisgl bench offline --output $OUT --page-size 64 --label offline-gpu-page64 2>&1 | grep -E "minisgl  |vs Mini"
