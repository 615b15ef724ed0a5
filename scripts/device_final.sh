#!/usr/bin/env bash
# Short verification call: GPU tests of the fused frontend (current default), the engine (CUDA graphs) and
# the Triton path, then the engine's end-to-end latency. Run via the device tool with carry [".whl"].
set -uo pipefail
source scripts/device_env.sh
python3 scripts/prewarm_logmel.py 2>&1 | tail -1 | tee "$OUT/prewarm.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_logmel_cuda.py tests/test_engine.py \
  tests/test_fast_path.py "tests/test_end_to_end.py::test_cuda_fp32_reference_path_tokens_equal_cpu" \
  -k "not nvrtc_compiles" 2>&1 | tee "$OUT/pytest_final.log" | tail -6
timeout 100 python3 scripts/device_engine_latency.py 2>&1 | tee "$OUT/engine_latency.log" | tail -30
