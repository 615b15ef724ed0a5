"""Compile every fused-frontend configuration the tests use, in parallel (NVRTC takes seconds per cubin cold).
Run on the device before the GPU tests, from the checkout root: python3 -m scripts.bench.prewarm_logmel"""

import time
from concurrent.futures import ProcessPoolExecutor

import torch

from glmasr_kernels.logmel._build import get_cubin
from tests.test_logmel_cuda import all_test_configs

if __name__ == "__main__":
    major, minor = torch.cuda.get_device_capability()
    configs = all_test_configs(major * 100 + minor * 10)
    t = time.time()
    with ProcessPoolExecutor(16) as ex:
        list(ex.map(get_cubin, configs))
    print(f"compiled {len(configs)} test configs in {time.time() - t:.1f} s")
