#!/usr/bin/env bash
# Device run for issue 3 (fused cuFFTDx log-mel frontend): install the carried wheels, compile
# every kernel configuration in parallel, run the GPU tests, then the benchmark.
# Usage (device tool, carry [".whl"]): bash scripts/device_issue3.sh   (logs + JSON under $OUT)
#        bash scripts/device_issue3.sh breakdown   (scripts/logmel_breakdown.py + Whisper-only bench)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
export GLMASR_CACHE_DIR=/tmp/glmasr_cubins FLASHMEL_CACHE_DIR=/tmp/flashmel_cache
SYS=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
# flashmel looks for the runtime headers next to mathdx: give it the image's CUDA runtime headers there too
cp -rn "$SYS"/nvidia/cu13/include/. /tmp/site/nvidia/cu13/include/ 2>/dev/null; ls /tmp/site/nvidia/cu13/include/cuda_fp16.h
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
if [ "${1:-}" = breakdown ]; then
    # Where the Whisper time goes (stage ablations, occupancy, tiling variants), then the Whisper
    # bench with flashmel graph-timed, then (time left) one Nsight Compute pass of the main kernel.
    timeout ${BREAKDOWN_TIMEOUT:-130} python3 scripts/logmel_breakdown.py --out "$OUT" 2>&1 | tee "$OUT/breakdown.log"
    timeout ${BENCH_TIMEOUT:-45} python3 scripts/bench_logmel.py --whisper-only --no-torchaudio --out "$OUT" 2>&1 | tee "$OUT/bench.log"
    if command -v ncu >/dev/null && [ "$SECONDS" -lt 165 ]; then
        timeout $((190 - SECONDS)) ncu --kernel-name logmel_main --launch-skip 1 --launch-count 1 \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
            python3 -c "import torch; from glmasr_kernels.logmel import whisper_features as w; x=torch.randn(128,480000,device='cuda')*0.1; w(x); w(x); torch.cuda.synchronize()" \
            > "$OUT/ncu.txt" 2>&1; tail -60 "$OUT/ncu.txt"
    else
        echo "ncu: $(command -v ncu || echo absent), t=${SECONDS}s"
    fi
    exit 0
fi
python3 scripts/prewarm_logmel.py 2>&1 | tee "$OUT/prewarm.log"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rs tests/test_logmel_cuda.py \
    -k "not nvrtc_compiles" --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log" | tail -60
timeout ${BENCH_TIMEOUT:-240} python3 scripts/bench_logmel.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
