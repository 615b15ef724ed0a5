#!/usr/bin/env bash
# Latency / decode / encoder / throughput / cold-start benchmark of our engine against transformers (eager,
# and static cache + torch.compile), all in one process on one GPU. Prints tables and writes
# OUT/benchmark.json (OUT defaults to ./bench_out).   bash benchmark.sh [--only SECTIONS] [--quick] [--no-peers] [--no-compiled-peer]
# On the H200 through the device tool: bash scripts/device.sh bench [ARGS] (or coldstart, all; see that script).
# Live sessions (issue 24): bash benchmark.sh --only realtime [--realtime-sessions 64,256,512]
#   [--realtime-partial-sessions 32,128] [--realtime-seconds 60]  (scripts/bench/realtime_load.py; ~1.5 min per N).
# The benchmark's helpers and the other device programs are in scripts/bench/ (kernels, log-mel, skinny GEMM,
# latency trace, GPU checks), all run as modules of the scripts package from the checkout root.
set -euo pipefail
cd "$(dirname "$0")"
# On the team's device machine the header wheels travel in .whl/ (see README, Development).
if [ -d .whl ] && ! python3 -c "import nvidia.mathdx" 2>/dev/null; then
    source scripts/device_env.sh
fi
python3 -m scripts.benchmark "$@"
