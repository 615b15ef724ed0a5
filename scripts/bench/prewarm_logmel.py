"""Compile every fused-frontend configuration the tests use, in parallel (NVRTC takes seconds per cubin cold).
Run on the device before the GPU tests: python3 scripts/bench/prewarm_logmel.py"""

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout root
from glmasr_kernels.logmel._build import get_cubin  # noqa: E402
from tests.test_logmel_cuda import all_test_configs  # noqa: E402

if __name__ == "__main__":
    major, minor = torch.cuda.get_device_capability()
    configs = all_test_configs(major * 100 + minor * 10)
    t = time.time()
    with ProcessPoolExecutor(16) as ex:
        list(ex.map(get_cubin, configs))
    print(f"compiled {len(configs)} test configs in {time.time() - t:.1f} s")
