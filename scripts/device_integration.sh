#!/usr/bin/env bash
# One device call: every GPU test (fused frontend, Triton kernels, Triton model path, reference path on CUDA),
# then the end-to-end latency with each frontend. Run via the device tool with carry [".whl"].
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 GLMASR_CACHE_DIR=/tmp/glmasr_cubins
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# compile the frontend's test configurations in parallel first (NVRTC, ~10 s each cold)
python3 - <<'PY' 2>&1 | tee "$OUT/prewarm.log"
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
python3 -m pytest -q -p no:cacheprovider tests -k "not nvrtc_compiles" 2>&1 | tee "$OUT/pytest_all_gpu.log" | tail -8
python3 scripts/device_integration.py 2>&1 | tee "$OUT/integration.log" | tail -30
