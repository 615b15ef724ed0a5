#!/usr/bin/env bash
# Device run for the Triton kernels (issue "[3 of 4] Triton kernels"): GPU tests, then the microbenchmark.
# Usage on the device machine, from the repo root:  bash scripts/device_issue4_kernels.sh [bench args]
# Logs and JSON under $OUT (or ./out when OUT is unset).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-./out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'
t0=$(date +%s)
python3 -m pytest -q -s -p no:cacheprovider --noconftest tests/test_triton_kernels.py 2>&1 | tee "$OUT/pytest_gpu.log" | grep -E '\[exact\]|passed|failed|FAILED|Error' | tail -40
echo "pytest rc=${PIPESTATUS[0]} ($(( $(date +%s) - t0 )) s)"
t1=$(date +%s)
python3 scripts/bench_kernels.py "$@" 2>&1 | tee "$OUT/bench.log"
echo "bench rc=${PIPESTATUS[0]} ($(( $(date +%s) - t1 )) s)"
