"""Resampling to 16 kHz and mixing channels to mono: the arithmetic shared by the decoders (files and bytes,
``decode.py``) and by arrays (``load.py``), and how many threads long audio gets.

- ``resample``: soxr's "HQ" resampler (the SoX resampler: a band-limited polyphase filter with a steep
  anti-alias filter, far more accurate than linear interpolation, fast on the CPU, librosa's default, which is what
  Whisper-family models were usually fed); long mono signals in blocks on threads where at least
  ``RESAMPLE_MIN_CPUS`` CPUs are usable (within float32 rounding of one call).
- ``channel_mean`` / ``mix`` / ``blockwise_mean``: the float64 channel mean, bit for bit numpy's, in cache-sized
  blocks.
- ``threads()``: ``AUDIO_THREADS``, else $GLMASR_AUDIO_THREADS, else the usable CPUs (at most 8).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .features import SAMPLE_RATE

PARALLEL_MIN_S = 60.0  # inputs at least this long decode (files) or resample (arrays) on threads
AUDIO_THREADS: int | None = None  # None: $GLMASR_AUDIO_THREADS, else the usable CPUs (at most 8); 1 = no threads
READ_BLOCK_FRAMES = 1 << 18  # at most this many frames per file read block, and per mono mix of an array
RESAMPLE_BLOCKS_PER_THREAD = 4
RESAMPLE_THREADS: int | None = None  # None: the decode threads where at least RESAMPLE_MIN_CPUS are usable, else 1
RESAMPLE_MIN_CPUS = 4  # on the 2-vCPU host block resampling was measured no faster than one soxr call
RESAMPLE_OVERLAP_S = 0.5  # input each resampling block sees beyond its ends


def threads() -> int:
    """Threads for decoding/resampling long audio: ``AUDIO_THREADS``, else $GLMASR_AUDIO_THREADS, else the CPUs
    this process may run on (at most 8)."""
    if AUDIO_THREADS is not None:
        return max(1, int(AUDIO_THREADS))
    env = os.environ.get("GLMASR_AUDIO_THREADS", "")
    if env.strip().isdigit():
        return max(1, int(env))
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def _resample_threads() -> int:
    n = threads()
    return n if n >= RESAMPLE_MIN_CPUS else 1


def mix(block: np.ndarray) -> np.ndarray:
    """(frames, channels) float32 -> mono float32, exactly as ``load._to_mono`` does it."""
    if block.shape[1] == 1:
        return block[:, 0].copy()
    return channel_mean(block, axis=1)


def channel_mean(block: np.ndarray, axis: int) -> np.ndarray:
    """The float64 mean over the channel ``axis``, as float32, bit for bit what ``block.mean(axis, dtype=float64)``
    gives: below 8 channels numpy's reduction adds the channels in order (no pairwise split), so one float64
    accumulator per sample adding channel after channel is the same arithmetic, 10x faster than numpy's reduction
    over a short axis."""
    channels = block.shape[axis]
    if channels >= 8:
        return block.mean(axis=axis, dtype=np.float64).astype(np.float32)
    take = (lambda c: block[:, c]) if axis == 1 else (lambda c: block[c])
    acc = take(0).astype(np.float64)
    for c in range(1, channels):
        acc += take(c)
    acc /= channels
    return acc.astype(np.float32)


def blockwise_mean(data: np.ndarray, axis: int) -> np.ndarray:
    """``channel_mean`` READ_BLOCK_FRAMES samples at a time (each sample's mean only involves its own channels, so
    blocks change nothing), keeping the float64 temporaries in cache: an hour of 44.1 kHz stereo mixes in 0.2 s,
    against 4-9 s for one ``mean(axis=1, dtype=float64)``."""
    n = data.shape[1 - axis]
    if n <= READ_BLOCK_FRAMES:
        return channel_mean(data, axis)
    out = np.empty(n, np.float32)
    for i in range(0, n, READ_BLOCK_FRAMES):
        block = data[i:i + READ_BLOCK_FRAMES] if axis == 1 else data[:, i:i + READ_BLOCK_FRAMES]
        out[i:i + READ_BLOCK_FRAMES] = channel_mean(block, axis)
    return out


def resample(samples: np.ndarray, rate: int, target: int = SAMPLE_RATE, threads: int | None = None) -> np.ndarray:
    """soxr HQ resampling of mono (1-D) or (frames, channels) samples to ``target`` Hz.

    ``threads`` (default: ``RESAMPLE_THREADS``, else the decode threads when at least ``RESAMPLE_MIN_CPUS`` CPUs
    are usable, else 1): with more than one, mono signals of at least ``PARALLEL_MIN_S`` seconds are resampled in
    blocks on that many threads. Not on small hosts: on 2 vCPUs it was slower than one soxr call (an hour at
    44.1 kHz: 0.74-1.54 s on 2 threads against 0.49-0.52 s; scripts/bench/audio_decode.py).
    The blocks start on the rates' common period (``rate / gcd`` input samples = ``target / gcd`` output samples,
    so every block's output grid is the one-shot grid); each is resampled with ``RESAMPLE_OVERLAP_S`` of input on
    both sides (far longer than the HQ filter) and the overlap is cut off. The first block starts and the last
    ends where the signal does, as in one call, so the length is soxr's. Difference from one call: float32
    rounding only (measured <= 3.3e-7 absolute, a few float32 ulps, on noise plus a tone peaking near 1 at 8,
    22.05, 44.056, 44.1 and 48 kHz; the tests hold it to 1e-6)."""
    if rate == target:
        return samples
    import soxr

    if threads is None:
        threads = RESAMPLE_THREADS if RESAMPLE_THREADS is not None else _resample_threads()
    threads = max(1, int(threads))
    n = samples.shape[0]
    g = math.gcd(int(rate), int(target))
    p, q = int(rate) // g, int(target) // g
    overlap = -(-int(RESAMPLE_OVERLAP_S * rate) // p) * p
    units = n // p  # whole periods
    if threads > 1 and samples.ndim == 1 and n >= PARALLEL_MIN_S * rate and units * p >= 8 * overlap:
        nblocks = max(2, min(threads * RESAMPLE_BLOCKS_PER_THREAD, units * p // (2 * overlap)))
        bounds = [round(i * units / nblocks) * p for i in range(nblocks)] + [n]
        out = np.empty(-(-n * q // p) + 1, np.float32)  # soxr gives about n * q / p (rounded): trimmed below

        def block(i: int) -> int:
            s, e = bounds[i], bounds[i + 1]
            a, b = max(0, s - overlap), min(n, e + overlap)
            y = soxr.resample(samples[a:b], rate, target, quality="HQ")
            lo, at = (s - a) // p * q, s // p * q
            m = y.shape[0] - lo if i == nblocks - 1 else (e - s) // p * q
            out[at:at + m] = y[lo:lo + m]
            return at + m

        with ThreadPoolExecutor(min(threads, nblocks)) as pool:
            end = list(pool.map(block, range(nblocks)))[-1]
        return out[:end]
    return soxr.resample(samples, rate, target, quality="HQ").astype(np.float32, copy=False)
