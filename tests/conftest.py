"""Shared fixtures: tiny random GLM-ASR checkpoints (both key layouts) and the transformers oracle."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from glmasr.random_checkpoint import build_checkpoint


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


@pytest.fixture(scope="session")
def tiny_asr(tiny_shipped):
    import glmasr

    return glmasr.load(tiny_shipped, device="cpu")


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
