#!/usr/bin/env bash
# Device calls for issue 4-of-4 (engine), one mode per call (device tool, carry [".whl"]):
#   bash scripts/device_issue5.sh tests   GPU tests of the engine, Triton path, skinny GEMM, frontend (~3 min)
#   bash scripts/device_skinny_gemm.sh    (separate call) sweep + tune the decode GEMV (~8 min)
#   bash scripts/device_issue5.sh bench   benchmark.sh, default paths, then the opt-in paths (~? min)
set -uo pipefail
source scripts/device_env.sh
mode=${1:-tests}
if [ "$mode" = tests ]; then
    python3 scripts/prewarm_logmel.py 2>&1 | tail -1
    timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_fast_path.py \
      tests/test_skinny_gemm.py tests/test_logmel_cuda.py tests/test_end_to_end.py -k "not nvrtc_compiles" 2>&1 \
      | tee "$OUT/pytest_issue5.log" | tail -8
elif [ "$mode" = bench ]; then
    timeout 420 bash benchmark.sh --out "$OUT/default" 2>&1 | tee "$OUT/bench_default.log" | tail -40
    GLMASR_ENCODER_GRAPHS=1 GLMASR_PREFILL_GRAPHS=1 GLMASR_DECODE_GEMM=skinny timeout 150 \
      bash benchmark.sh --only latency,decode,encoder --no-peers --out "$OUT/optin" 2>&1 | tee "$OUT/bench_optin.log" | tail -30
else
    echo "unknown mode $mode (tests | bench)"; exit 2
fi
