"""The benchmark's synthetic audio, shared by scripts/benchmark.py and its child processes (coldstart_child.py),
so a fresh process measures exactly the clips the in-process sections do. Timing does not depend on the audio's
content (forced token counts), only on its lengths."""

from __future__ import annotations

import numpy as np
import torch


def noise_clip(seconds: float, seed: int = 0) -> np.ndarray:
    """``seconds`` of 16 kHz Gaussian noise (std 0.1), float32, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(int(seconds * 16000), generator=g) * 0.1).numpy()


def mixed_clips(n: int) -> list[np.ndarray]:
    """Issue 13's mixed workload: ``n`` clips of 1-30 s, lengths uniform (numpy seed 1), clip i from seed 1000+i."""
    seconds = np.random.default_rng(1).uniform(1.0, 30.0, n)
    return [noise_clip(float(s), seed=1000 + i) for i, s in enumerate(seconds)]
