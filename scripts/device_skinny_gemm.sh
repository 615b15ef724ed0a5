#!/usr/bin/env bash
# Device run for the skinny decode GEMMs (kernels/skinny_gemm.py): GPU tests, then autotune sweep + benchmark
# (per shape vs cuBLAS, and the whole decoder weight set in one CUDA graph). One call, ~6-8 minutes.
# Usage on the device machine, from the repo root:  bash scripts/device_skinny_gemm.sh [extra bench args]
# Logs, JSON and the tuned config table (skinny_configs.py) under $OUT (or ./out when OUT is unset).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-./out}
export OUT
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' 2>&1 | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
timeout 200 python3 -m pytest -q -s -p no:cacheprovider --noconftest tests/test_skinny_gemm.py 2>&1 \
  | tee "$OUT/pytest_gpu.log" | grep -E '\[exact\]|passed|failed|FAILED|Error' | tail -45
echo "pytest rc=${PIPESTATUS[0]} ($(( $(date +%s) - t0 )) s)"
t1=$(date +%s)
# sweep budget: whatever is left of ~540 s after the tests, minus ~120 s for the benchmark itself
left=$(( 540 - ($(date +%s) - t0) - 120 ))
[ "$left" -lt 60 ] && left=60
timeout $(( left + 150 )) python3 scripts/bench_skinny_gemm.py --sweep --budget "$left" "$@" 2>&1 | tee "$OUT/bench.log"
echo "bench rc=${PIPESTATUS[0]} ($(( $(date +%s) - t1 )) s)"
