"""Shared fixtures: tiny random GLM-ASR checkpoints (both key layouts) and the transformers oracle."""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

# The kernel tests' shared set-up. Without a GPU the Triton kernels run under Triton's interpreter; Triton reads
# TRITON_INTERPRET when a kernel is defined, so it is set here, before anything imports glmasr_kernels.
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
gpu_only = pytest.mark.skipif(not CUDA, reason="real-shape test needs a CUDA GPU (too slow for the CPU interpreter)")


def require_kernels():
    """At a kernel test module's top: Triton installed, and a GPU or the interpreter (else the module skips)."""
    pytest.importorskip("triton")
    if not CUDA and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("no CUDA and TRITON_INTERPRET is off", allow_module_level=True)


from glmasr.checkpoint.random_weights import build_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_shipped(tmp_path_factory):
    """Tiny random checkpoint in the Hub's shipped layout (audio_tower.*, language_model.model.*, ...)."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny_shipped"), size="tiny", layout="shipped", seed=0)


@pytest.fixture(scope="session")
def tiny_transformers(tmp_path_factory):
    """The same weights (same seed) in transformers' runtime layout (model.audio_tower.*, tied lm head)."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny_tf"), size="tiny", layout="transformers", seed=0)


@pytest.fixture(scope="session")
def hf_oracle(tiny_transformers):
    from transformers import AutoProcessor, GlmAsrForConditionalGeneration

    processor = AutoProcessor.from_pretrained(str(tiny_transformers))
    model = GlmAsrForConditionalGeneration.from_pretrained(str(tiny_transformers), dtype=torch.float32).eval()
    return processor, model


@pytest.fixture(scope="module")
def asr(tiny_shipped):
    """The tiny checkpoint on the CPU with 8 sequence slots, one per test module (closed after it): the engine the
    server tests serve and compare against."""
    import glmasr

    handle = glmasr.load(tiny_shipped, device="cpu", max_batch=8)
    yield handle
    handle.close()


@pytest.fixture
def hub_offline(monkeypatch, tmp_path):
    """The Hugging Face hub offline with an empty cache: a hub id resolves to nothing."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="session")
def tiny_asr(tiny_shipped):
    import glmasr

    return glmasr.load(tiny_shipped, device="cpu")


def pyav_encode(x, rate: int, fmt: str, codec: str, layout: str = "mono", path=None, options=None) -> bytes:
    """Samples ((frames,) or (frames, channels), float in [-1, 1)) encoded with PyAV (FFmpeg) into the container
    ``fmt`` with ``codec`` (e.g. AAC in mp4/m4a/adts, Opus in webm, float PCM in Matroska, ALAC), written to
    ``path`` when given; returns the encoded bytes. ``options``: the muxer's (e.g. movflags)."""
    import av

    x = np.asarray(x, np.float32)
    x = x[:, None] if x.ndim == 1 else x
    target = io.BytesIO() if path is None else str(path)
    with av.open(target, "w", format=fmt, options=options or {}) as c:
        s = c.add_stream(codec, rate=rate, layout=layout)
        if codec == "libopus":
            s.codec_context.format = "flt"
        sample_fmt = s.codec_context.format.name
        step, pts = s.codec_context.frame_size or 4096, 0
        for i in range(0, x.shape[0], step):
            block = x[i:i + step]
            arr = block.T if sample_fmt.endswith("p") else block.reshape(1, -1)
            if sample_fmt.startswith(("s16", "s32")):  # integer PCM codecs (ALAC)
                bits = 15 if sample_fmt.startswith("s16") else 31
                arr = np.round(arr * (2 ** bits - 1)).astype(np.int16 if bits == 15 else np.int32)
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(arr), format=sample_fmt, layout=layout)
            frame.sample_rate, frame.pts = rate, pts
            pts += block.shape[0]
            for packet in s.encode(frame):
                c.mux(packet)
        for packet in s.encode(None):
            c.mux(packet)
    return target.getvalue() if path is None else Path(path).read_bytes()


def noise(seconds: float, seed: int, rate: int = 16000, scale: float = 0.1) -> np.ndarray:
    """Fresh random audio (never zeros): noise with a slow amplitude envelope, like speech bursts."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * rate))
    envelope = 0.5 + 0.5 * np.sin(np.linspace(0, 2 * np.pi * max(1.0, seconds / 2), n)) ** 2
    return (rng.standard_normal(n) * scale * envelope).astype(np.float32)


@pytest.fixture
def nan_kv_cache(monkeypatch):
    """``poison(asr)``: fill the KV cache of ``asr``'s engine (if built) and of every KVCache created from now on
    with NaN. Slots a sequence has not written must never reach a result."""
    from glmasr.models import kv_cache

    original_init = kv_cache.KVCache.__init__

    def poisoned_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.k.fill_(float("nan"))
        self.v.fill_(float("nan"))

    def poison(asr):
        monkeypatch.setattr(kv_cache.KVCache, "__init__", poisoned_init)
        if asr._engine is not None:
            with torch.inference_mode():  # the engine may have grown its cache inside inference mode
                asr._engine.runner.cache.k.fill_(float("nan"))
                asr._engine.runner.cache.v.fill_(float("nan"))

    return poison


def bounded(fn, timeout: float):
    """``fn()`` in a daemon thread, waited for at most ``timeout`` s: a hang fails the test, not the suite."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"did not finish within {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def wait_healthy(get, timeout: float = 60.0) -> None:
    """Poll ``get("/health")`` until it answers 200: an app's warm-up (even ``warmup="none"``: the prompts, the live
    VAD) runs in its lifespan, so a request before it ends is a 503."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if get("/health").status_code == 200:
                return
        except Exception:  # noqa: BLE001 - the server may not answer yet
            pass
        assert time.monotonic() < deadline, "the server did not become healthy in time"
        time.sleep(0.05)
