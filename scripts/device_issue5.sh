#!/usr/bin/env bash
# Device calls for issue 4-of-4 (engine), one mode per call (device tool, carry [".whl"]):
#   bash scripts/device_issue5.sh tests+sweep   the tests, then the skinny GEMM sweep in what is left of ~9 min
#   bash scripts/device_issue5.sh check   GPU tests of the changed kernels/engine + our numbers without peers
#   bash scripts/device_issue5.sh final   GPU tests of the last change + the full benchmark.sh --compiled-peer (~9.5 min)
#   bash scripts/device_issue5.sh tests   GPU tests of the engine, Triton path, skinny GEMM, frontend (~3 min)
#   bash scripts/device_skinny_gemm.sh    (separate call) sweep + tune the decode GEMV (~8 min)
#   bash scripts/device_issue5.sh bench   the whole benchmark.sh with --compiled-peer (~5-8 min)
#   bash scripts/device_issue5.sh trace   engine/API GPU tests + scripts/latency_trace.py (~3 min)
#   bash scripts/device_issue5.sh logmel  frontend GPU tests + scripts/check_stage_timings.py (~4 min)
set -uo pipefail
source scripts/device_env.sh
mode=${1:-tests}
if [ "$mode" = tests ]; then
    python3 scripts/prewarm_logmel.py 2>&1 | tail -1
    timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_fast_path.py \
      tests/test_skinny_gemm.py tests/test_logmel_cuda.py tests/test_end_to_end.py -k "not nvrtc_compiles" 2>&1 \
      | tee "$OUT/pytest_issue5.log" | tail -8
elif [ "$mode" = tests+sweep ]; then
    t0=$(date +%s)
    python3 scripts/prewarm_logmel.py 2>&1 | tail -1
    timeout 260 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_fast_path.py \
      tests/test_skinny_gemm.py tests/test_logmel_cuda.py tests/test_end_to_end.py -k "not nvrtc_compiles" 2>&1 \
      | tee "$OUT/pytest_issue5.log" | tail -8
    echo "tests took $(( $(date +%s) - t0 )) s"
    left=$(( 555 - ($(date +%s) - t0) - 110 ))
    [ "$left" -lt 60 ] && left=60
    timeout $(( left + 120 )) python3 scripts/bench_skinny_gemm.py --sweep --budget "$left" 2>&1 \
      | tee "$OUT/bench_skinny.log" | tail -60
elif [ "$mode" = check ]; then
    # after kernel changes: the GPU tests of everything touched, then our engine's numbers (no peers)
    python3 scripts/prewarm_logmel.py 2>&1 | tail -1
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_skinny_gemm.py tests/test_triton_kernels.py \
      tests/test_fast_path.py tests/test_engine.py tests/test_end_to_end.py 2>&1 | tee "$OUT/pytest_check.log" | tail -6
    timeout 280 bash benchmark.sh --only breakdown,decode,encoder,latency --no-peers --out "$OUT/ours" 2>&1 \
      | tee "$OUT/bench_ours.log" | grep -v '^ \|^{$\|^}$' | tail -30
elif [ "$mode" = final ]; then
    # one call: the GPU tests of the last kernel change, then the full benchmark.sh with the peers
    t0=$(date +%s)
    timeout 290 python3 -m pytest -q -p no:cacheprovider tests/test_fast_path.py tests/test_skinny_gemm.py \
      tests/test_engine.py tests/test_end_to_end.py tests/test_logmel_cuda.py -k "not nvrtc_compiles" 2>&1 \
      | tee "$OUT/pytest_final.log" | tail -4
    echo "tests took $(( $(date +%s) - t0 )) s"
    timeout $(( 580 - ($(date +%s) - t0) )) bash benchmark.sh --compiled-peer --out "$OUT/bench" 2>&1 \
      | tee "$OUT/bench_full.log" | grep -v '^ \|^{$\|^}$\|^W1' | tail -50
    left=$(( 585 - ($(date +%s) - t0) ))
    echo "benchmark done at $(( $(date +%s) - t0 )) s"
    if [ "$left" -gt 75 ]; then
        timeout "$left" python3 scripts/latency_trace.py --out "$OUT/trace" 2>&1 | grep -v '^W1' | head -12
    fi
elif [ "$mode" = bench ]; then
    # the whole benchmark in one call, with the compiled transformers peer (not yet run on the H200)
    timeout 570 bash benchmark.sh --compiled-peer --out "$OUT/bench" 2>&1 | tee "$OUT/bench_full.log" \
      | grep -v '^ \|^{$\|^}$\|^W1' | tail -45
elif [ "$mode" = logmel ]; then
    # the frontend's GPU tests in full (eager calls bypass the custom op now) + the CUDA stage timings
    timeout 270 python3 -m pytest -q -p no:cacheprovider tests/test_logmel_cuda.py -k "not nvrtc_compiles" \
      --durations=5 2>&1 | tee "$OUT/pytest_logmel.log" | tail -12
    timeout 90 python3 scripts/check_stage_timings.py 2>&1 | grep -v '^W1' | tail -4
elif [ "$mode" = trace ]; then
    # GPU tests of the engine / API, then the batch-1 latency traced (GPU idle gaps, host profile)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_end_to_end.py 2>&1 \
      | tee "$OUT/pytest_trace.log" | tail -4
    timeout 300 python3 scripts/latency_trace.py --out "$OUT/trace" 2>&1 | grep -v '^W1' | tail -120
else
    echo "unknown mode $mode (tests+sweep | check | final | tests | bench | trace | logmel)"; exit 2
fi
