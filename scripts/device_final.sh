#!/usr/bin/env bash
# Short verification call: GPU tests of the fused frontend (current default), the engine (CUDA graphs) and
# the Triton path, then the engine's end-to-end latency. Run via the device tool with carry [".whl"].
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 GLMASR_CACHE_DIR=/tmp/glmasr_cubins
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 - <<'PY' 2>&1 | tail -1 | tee "$OUT/prewarm.log"
import time, torch
from concurrent.futures import ProcessPoolExecutor
from tests.test_logmel_cuda import all_test_configs
from kernels.logmel._build import get_cubin
maj, mi = torch.cuda.get_device_capability()
cfgs = all_test_configs(maj * 100 + mi * 10)
t = time.time()
with ProcessPoolExecutor(16) as ex:
    list(ex.map(get_cubin, cfgs))
print(f"compiled {len(cfgs)} test configs in {time.time() - t:.1f} s")
PY
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_logmel_cuda.py tests/test_engine.py \
  tests/test_fast_path.py "tests/test_end_to_end.py::test_cuda_fp32_reference_path_tokens_equal_cpu" \
  -k "not nvrtc_compiles" 2>&1 | tee "$OUT/pytest_final.log" | tail -6
timeout 100 python3 scripts/device_engine_latency.py 2>&1 | tee "$OUT/engine_latency.log" | tail -30
