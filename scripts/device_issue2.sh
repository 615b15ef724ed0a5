#!/usr/bin/env bash
# One device call for issue 1-of-4: GPU tests of the reference path + the full-size GPU check.
# Run through the device tool with carry [".whl"] (soundfile, soxr wheels; see README "Development").
set -uo pipefail
source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q tests/test_config.py tests/test_features.py tests/test_audio.py tests/test_weights.py \
  tests/test_tokenizer.py tests/test_end_to_end.py tests/test_fast_path.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_issue2.log" | tail -15
python3 scripts/device_issue2.py 2>&1 | tee "$OUT/issue2_gpu_check.log" | tail -40
