#!/usr/bin/env bash
# The one device script: tests, benchmarks and checks on the H200, one mode per device-tool call (carry [".whl"]).
#
#   bash scripts/device.sh MODE [ARGS]
#
# mode                     what (budget of each step, s; the whole call ends by ~580 s). GLMASR_COMMIT=REV names the
#                          checkout in the header (the device copy's git metadata may lag the working tree)
# tests [PYTEST-ARGS]      prewarm the log-mel cubins (<= 120), then pytest (all that is left, ~540): by default the
#                          GPU-heavy files first, then the rest of tests/, -k "not nvrtc_compiles"; PYTEST-ARGS
#                          replace that selection. Stops starting tests when its budget is spent (pytest_budget).
# bench [ARGS]             bash benchmark.sh --out OUT/bench ARGS (~555)
# coldstart [ARGS]         bash benchmark.sh --only coldstart --no-peers --out OUT/coldstart ARGS (~555): 4 fresh
#                          processes (warm-up on/off x caches cold/warm), each stage of import, load, warm-up and
#                          the first transcript (scripts/bench/coldstart_child.py); the per-stage table comes last
# kernels [ARGS]           bench_kernels ARGS (default --quick --compile-budget-s 90) (300), bench_skinny_gemm
#                          --quick (150), bench_logmel --whisper-only --no-torchaudio (the rest, <= 120)
# logits [PARTS]           gpu_check PARTS (default: logits e2e decode encoder): bf16 logits vs transformers,
#                          end-to-end wall, decode-step graph, encoder per window (~555)
# sweep [ARGS]             tests/test_skinny_gemm.py (200), then bench_skinny_gemm --sweep --budget (rest - 150)
#                          ARGS: tunes the decode GEMV configs (OUT/skinny_configs.py) (the rest, ~350)
# trace                    latency_trace --out OUT/trace: the 3.5 s / 13-token case profiled (~555)
# logmel [ARGS]            bench_logmel ARGS (240), one ncu pass if >= 80 s are left
# cost [ARGS]              tests first when ALL_TESTS_ARGS is set (${ALL_TESTS_S:-200}), then words_speakers_cost
#                          (aligner and diarizer per 30 s window and per hour, ~360) and segments_cost (the rest);
#                          ARGS go to words_speakers_cost. Speech from .bench_audio/ when carried (no espeak-ng there)
# int8 [ARGS]              tests first when ALL_TESTS_ARGS is set (${ALL_TESTS_S:-200}), then int8_agreement (int8
#                          decode weights against bf16: logit error, top-1 agreement, ms/token; 150) and
#                          bench_skinny_gemm --quick --int8 --no-decoder (every GEMV's % of copy peak, bf16 and int8)
# realtime [ARGS]          bash benchmark.sh --only realtime --no-peers --out OUT/realtime ARGS (~555), the sessions
#                          streaming .bench_audio/realtime_speech.flac when carried
# live [ARGS]              live sessions through glmasr serve --frontends 4 (.bench_audio speech when carried) on
#                          the steady checkpoint (drafts agree: scripts/bench/steady_checkpoint.py): realtime_load
#                          --sessions 256,512,640,768 --partial-sessions 128,192,256 --seconds 30 with the server's
#                          engine step log and front-end finals log (scripts/bench/forced_serve.py; both tarred into
#                          OUT/live_logs.tgz) (the rest); ARGS go to realtime_load (later flags win)
# gemv [ARGS]              tests first when ALL_TESTS_ARGS is set (${ALL_TESTS_S:-200}), then bench_cuda_gemv ARGS
#                          (default --quick): the CUDA decode GEMVs against the Triton ones, per shape and chained
# decode [ARGS]            tests first when ALL_TESTS_ARGS is set (${ALL_TESTS_S:-200}), then decode_variants ARGS
#                          (default --int8 --rounds 3): the batch-1 decode step per variant, interleaved rounds
# record [BENCH-ARGS]      scripts/record_kernels (every Triton specialization the product uses, into
#                          kernels/manifests/sm90.json, copied to OUT; 200), then bash benchmark.sh --out OUT/bench
#                          BENCH-ARGS with the rest (e.g. --only coldstart,firstcall --no-peers: `glmasr compile`
#                          then builds from the manifest just recorded)
# all [BENCH-ARGS]         tests (${ALL_TESTS_S:-200}, prewarm included; ALL_TESTS_ARGS="FILES -k ..." replaces the
#                          selection), then bash benchmark.sh BENCH-ARGS with the rest (~345)
#
# Every step runs under `timeout -s INT -k 15 BUDGET` (clamped to what is left of DEVICE_DEADLINE_S=580 less a
# 25 s reserve), its whole output goes to OUT/<step>.log (benchmark JSON under OUT/bench or OUT/coldstart), and a
# summary table (scripts/bench/summary.py, also OUT/summary.md) comes last. The programs of scripts/bench/ run as
# modules of the scripts package (python3 -m scripts.bench.NAME) from the checkout root. Each mode leaves at most 8 files under
# OUT, none deeper than 2 folders (what the device tool brings back). DEVICE_DRY_RUN=1 prints the steps and
# their budgets without running anything, each step assumed to use all of its budget (works on any machine);
# DEVICE_ENV=0 uses the current Python environment instead of scripts/device_env.sh (a GPU box with everything
# installed). Exit status: 0 when every step exited 0.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-help}
[ $# -gt 0 ] && shift
DEADLINE=${DEVICE_DEADLINE_S:-580}
RESERVE=25      # timeout's kill grace (15 s) + the summary
MIN_STEP=30     # a step with less time than this is skipped
DRY=${DEVICE_DRY_RUN:-0}
MODES="tests bench coldstart kernels logits sweep trace logmel cost int8 realtime live gemv decode record all"

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
case " $MODES " in
    *" $MODE "*) ;;
    *) usage; [ "$MODE" = help ] || [ "$MODE" = -h ] || [ "$MODE" = --help ] && exit 0
       echo "unknown mode '$MODE' (one of: $MODES)"; exit 2 ;;
esac

SIM=0           # dry run: the seconds the steps so far would have taken at most
if [ "$DRY" = 1 ]; then
    OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
    HEADER="dry run (DEVICE_DRY_RUN=1): nothing was run; each step assumed to take its whole budget"
else
    if [ "${DEVICE_ENV:-1}" = 1 ]; then
        source scripts/device_env.sh
    else
        OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
    fi
    gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv,noheader 2>/dev/null | head -1)
    versions=$(python3 -c 'import torch, triton, transformers as t; print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {t.__version__}")' 2>&1 | tail -1)
    HEADER="${gpu:-no GPU seen by nvidia-smi}; $versions; checkout ${GLMASR_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "(no git)")}; $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "$HEADER"
fi
export OUT
STEPS=()      # --step arguments of summary.py: name|rc|seconds|budget|log
FAILED=0
BENCH_FILTER='^ \|^{$\|^}$\|^W1'   # the console shows benchmark.py's tables, not its closing JSON dump

# budget_for WANT: WANT seconds, or what is left before the deadline (less the reserve) when that is less
budget_for() {
    local left=$(( DEADLINE - SECONDS - SIM - RESERVE ))
    if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}

# [FILTER=grep-v-regex] step NAME WANT LOG CMD...: CMD under a timeout of budget_for WANT, its output in OUT/LOG
step() {
    local name=$1 budget log=$3 t0=$SECONDS rc
    budget=$(budget_for "$2")
    shift 3
    if [ "$budget" -lt "$MIN_STEP" ]; then
        echo "== [$name] skipped: only ${budget}s left"
        STEPS+=(--step "$name|skipped|0|$budget|")
        return 0
    fi
    echo "== [$name] budget ${budget}s (t=$(( SECONDS + SIM ))s): $*"
    if [ "$DRY" = 1 ]; then
        SIM=$(( SIM + budget ))
        STEPS+=(--step "$name|dry|0|$budget|")
        return 0
    fi
    timeout -s INT -k 15 "$budget" "$@" 2>&1 | tee "$OUT/$log" | {
        if [ -n "${FILTER:-}" ]; then grep --line-buffered -v "$FILTER"; else cat; fi; }
    rc=${PIPESTATUS[0]}
    echo "== [$name] rc=$rc in $(( SECONDS - t0 ))s"
    [ "$rc" = 0 ] || FAILED=1
    STEPS+=(--step "$name|$rc|$(( SECONDS - t0 ))|$budget|$log")
}

# The GPU-heavy test files first (a budget cut then loses the cheap CPU ones), then every other file of tests/,
# each named: given a folder, pytest 9 collects it in its own (alphabetical) order, files named before it included.
PRIORITY_TESTS=(tests/test_engine.py tests/test_fast_path.py tests/test_skinny_gemm.py tests/test_end_to_end.py
                tests/test_triton_kernels.py tests/test_logmel_cuda.py)
for f in tests/test_*.py; do
    [[ " ${PRIORITY_TESTS[*]} " == *" $f "* ]] || PRIORITY_TESTS+=("$f")
done

# run_tests WANT [PYTEST-ARGS]: the cubin prewarm (when the log-mel tests are selected), then pytest
run_tests() {
    local want=$1 b
    shift
    local args=("$@")
    [ ${#args[@]} -gt 0 ] || args=("${PRIORITY_TESTS[@]}" -k "not nvrtc_compiles")
    if [ -z "$*" ] || [[ " $* " == *logmel* ]] || [[ " $* " == *" tests "* ]] || [[ " $* " == *" tests/ "* ]]; then
        step prewarm $(( want / 2 < 120 ? want / 2 : 120 )) prewarm.log python3 -m scripts.bench.prewarm_logmel
    fi
    b=$(budget_for $(( want - (SECONDS + SIM - T_TESTS) )))
    # pytest stops starting tests 40 s before the timeout: a test in flight can finish and the summary prints
    step pytest "$b" pytest.log python3 -m pytest -q \
        -p no:cacheprovider -p scripts.bench.pytest_budget --budget-s $(( b > 80 ? b - 40 : b / 2 )) -rfE --durations=10 \
        "${args[@]}"
}

T_TESTS=$SECONDS
case $MODE in
    tests)
        run_tests 600 "$@" ;;
    bench)
        FILTER=$BENCH_FILTER step bench 600 bench.log bash benchmark.sh --out "$OUT/bench" "$@" ;;
    coldstart)
        FILTER=$BENCH_FILTER step coldstart 600 coldstart.log bash benchmark.sh --only coldstart --no-peers \
            --out "$OUT/coldstart" "$@" ;;
    kernels)
        [ $# -gt 0 ] || set -- --quick --compile-budget-s 90
        step bench_kernels 300 bench_kernels.log python3 -m scripts.bench.bench_kernels "$@"
        step bench_skinny 150 bench_skinny.log python3 -m scripts.bench.bench_skinny_gemm --quick
        step bench_logmel 120 bench_logmel.log python3 -m scripts.bench.bench_logmel --whisper-only --no-torchaudio ;;
    logits)
        [ $# -gt 0 ] || set -- logits e2e decode encoder
        step gpu_check 600 gpu_check.log python3 -m scripts.bench.gpu_check --out "$OUT" "$@" ;;
    sweep)
        run_tests 200 tests/test_skinny_gemm.py
        b=$(budget_for 600)
        step sweep "$b" sweep.log python3 -m scripts.bench.bench_skinny_gemm --sweep \
            --budget $(( b - 150 > 60 ? b - 150 : 60 )) "$@" ;;
    trace)
        step trace 600 trace.log python3 -m scripts.bench.latency_trace --out "$OUT/trace" ;;
    logmel)
        export FLASHMEL_CACHE_DIR=${FLASHMEL_CACHE_DIR:-/tmp/flashmel_cache}
        if [ "$DRY" != 1 ] && python3 -c "import flashmel" 2>/dev/null; then
            # flashmel (an optional peer) looks for the CUDA runtime headers next to mathdx: put the image's there
            SYS=$(python3 -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
            cp -rn "$SYS"/nvidia/cu13/include/. /tmp/site/nvidia/cu13/include/ 2>/dev/null
        fi
        step bench_logmel 240 bench_logmel.log python3 -m scripts.bench.bench_logmel --out "$OUT" "$@"
        if command -v ncu >/dev/null && [ "$(budget_for 120)" -ge 80 ]; then
            step ncu 120 ncu.txt ncu --kernel-name logmel_main --launch-skip 1 --launch-count 1 \
                --section SpeedOfLight --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
                python3 -c "import torch; from glmasr_kernels.logmel import whisper_features as w; x=torch.randn(128,480000,device='cuda')*0.1; w(x); w(x); torch.cuda.synchronize()"
        fi ;;
    cost)
        # shellcheck disable=SC2086 # ALL_TESTS_ARGS: pytest arguments (files, -k), split on spaces
        [ -z "${ALL_TESTS_ARGS:-}" ] || run_tests "${ALL_TESTS_S:-200}" ${ALL_TESTS_ARGS}
        speech=(); conv=(); minute=()
        [ -f .bench_audio/minute_speech.flac ] && speech=(--audio .bench_audio/minute_speech.flac) \
            && minute=(--audio .bench_audio/minute_speech.flac)
        [ -f .bench_audio/conversation.flac ] && conv=(--conversation .bench_audio/conversation.flac)
        step words_speakers 360 words_speakers.log python3 -m scripts.bench.words_speakers_cost \
            --json "$OUT/words_speakers_cost.json" "${speech[@]}" "${conv[@]}" "$@"
        step segments 600 segments.log python3 -m scripts.bench.segments_cost --json "$OUT/segments_cost.json" \
            "${minute[@]}" ;;
    int8)
        # shellcheck disable=SC2086 # ALL_TESTS_ARGS: pytest arguments (files, -k), split on spaces
        [ -z "${ALL_TESTS_ARGS:-}" ] || run_tests "${ALL_TESTS_S:-200}" ${ALL_TESTS_ARGS}
        step int8_agreement 150 int8_agreement.log python3 -m scripts.bench.int8_agreement \
            --json "$OUT/int8_agreement.json" "$@"
        step bench_skinny 600 bench_skinny.log python3 -m scripts.bench.bench_skinny_gemm --quick --int8 --no-decoder ;;
    realtime)
        rt=()
        [ -f .bench_audio/realtime_speech.flac ] && rt=(--realtime-audio .bench_audio/realtime_speech.flac)
        FILTER=$BENCH_FILTER step realtime 600 realtime.log bash benchmark.sh --only realtime --no-peers \
            --out "$OUT/realtime" "${rt[@]}" "$@" ;;
    live)
        rt=()
        [ -f .bench_audio/realtime_speech.flac ] && rt=(--audio .bench_audio/realtime_speech.flac)
        step live 600 live.log env GLMASR_BENCH_STEP_LOG=/tmp/live_steps_ GLMASR_BENCH_FINALS_LOG=/tmp/live_finals_ \
            python3 -m scripts.bench.realtime_load --sessions 256,512,640,768 --partial-sessions 128,192,256 \
            --seconds 30 --server-flag=--frontends=4 --out /tmp/live --json "$OUT/live.json" "${rt[@]}" "$@"
        if [ "$DRY" != 1 ]; then
            tar czf "$OUT/live_logs.tgz" /tmp/live_steps_* /tmp/live_finals_* 2>/dev/null || true
        fi ;;
    gemv)
        # shellcheck disable=SC2086 # ALL_TESTS_ARGS: pytest arguments (files, -k), split on spaces
        [ -z "${ALL_TESTS_ARGS:-}" ] || run_tests "${ALL_TESTS_S:-200}" ${ALL_TESTS_ARGS}
        [ $# -gt 0 ] || set -- --quick
        step bench_cuda_gemv 600 bench_cuda_gemv.log python3 -m scripts.bench.bench_cuda_gemv --out "$OUT" "$@" ;;
    decode)
        # shellcheck disable=SC2086 # ALL_TESTS_ARGS: pytest arguments (files, -k), split on spaces
        [ -z "${ALL_TESTS_ARGS:-}" ] || run_tests "${ALL_TESTS_S:-200}" ${ALL_TESTS_ARGS}
        [ $# -gt 0 ] || set -- --int8 --rounds 3
        step decode_variants 600 decode_variants.log python3 -m scripts.bench.decode_variants \
            --json "$OUT/decode_variants.json" "$@" ;;
    record)
        step record 200 record.log python3 -m scripts.record_kernels --out kernels/manifests/sm90.json
        [ "$DRY" = 1 ] || cp kernels/manifests/sm90.json "$OUT/sm90.json"
        FILTER=$BENCH_FILTER step bench 600 bench.log bash benchmark.sh --out "$OUT/bench" "$@" ;;
    all)
        # shellcheck disable=SC2086 # ALL_TESTS_ARGS: pytest arguments (files, -k), split on spaces
        run_tests "${ALL_TESTS_S:-200}" ${ALL_TESTS_ARGS:-}
        FILTER=$BENCH_FILTER step bench 600 bench.log bash benchmark.sh --out "$OUT/bench" "$@" ;;
esac

python3 -m scripts.bench.summary --out "$OUT" --mode "$MODE${*:+ $*}" --header "$HEADER" "${STEPS[@]}"
exit $FAILED
