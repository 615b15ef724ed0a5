#!/usr/bin/env bash
# One device call for issue 3-of-4: all GPU tests of the Triton path, the end-to-end check (logits, decode-step
# graphs, encoder), then the kernel microbenchmark. Run via the device tool with carry [".whl"].
set -uo pipefail
source scripts/device_env.sh
python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_fast_path.py \
  tests/test_end_to_end.py 2>&1 | tee "$OUT/pytest_issue4.log" | tail -6
python3 scripts/device_issue4.py 2>&1 | tee "$OUT/issue4_e2e.log" | tail -32
python3 scripts/bench_kernels.py --quick --compile-budget-s 90 2>&1 | tee "$OUT/bench_kernels.log" | tail -45
