"""Voice-activity detection (glmasr/audio/vad.py): our PyTorch Silero VAD against the shipped ONNX model run by
onnxruntime, speech regions on speech synthesized with espeak-ng (resampled to 16 kHz with sox) placed at known
offsets into low noise, batched streams against one stream, merging into <= 30 s pieces, the missing-wheel error.

Needs the ``vad`` extra (silero-vad; the ``test`` extra has it and onnxruntime) and, for the speech tests, the
``espeak-ng`` and ``sox`` programs (Debian: ``apt-get install -y espeak-ng sox``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors")
try:
    import importlib.metadata as _md

    _md.distribution("silero-vad")
except Exception:  # pragma: no cover - the test extra installs it
    pytest.skip("the silero-vad wheel is not installed (pip install glmasr[vad])", allow_module_level=True)

from glmasr.audio import vad  # noqa: E402

SR = 16000
NOISE = 0.003  # low background noise (~ -50 dBFS)
TOL_S = 0.1  # region boundaries vs. where the speech was put
# Our fp32 network vs onnxruntime's fp32 one: the same operations in a different summation order (the 256-tap STFT
# conv, the 387- and 384-term encoder conv sums, 128-term LSTM dot products), each rounding at ~1e-7 relative; the
# recurrence carries the differences but the saturating gates do not grow them. Measured with the state carried:
# <= 2.2e-7 over 4 x 400 windows of random audio, 1.8e-6 to 3.4e-6 over 1250 windows of speech (it varies from run
# to run at that level: oneDNN's threaded reductions). 1e-5 is a 3x margin over the worst seen, and ~1e4 times
# finer than anything a 0.5 threshold can notice.
PROB_ATOL = 1e-5

SENTENCES = [  # start and end on voiced sounds, so that "where the speech is" is well defined
    "My mother made a warm meal for the whole family last night.",
    "Many people now listen to long recordings of meetings and lectures.",
    "All around the world, new machines learn to understand human language.",
    "We will meet again in the morning, and then we will travel home.",
    "Our engine reads the audio and writes the words down in order.",
    "I would like a room near the main hall, if one is free.",
]


# -- synthesized speech -----------------------------------------------------------------------------------------
def _synthesize(text: str, tmp: str, voice: str = "en-us", speed: int = 160) -> np.ndarray:
    import soundfile as sf

    raw, out = os.path.join(tmp, "espeak.wav"), os.path.join(tmp, "16k.wav")
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", raw, text], check=True, capture_output=True)
    if shutil.which("sox"):
        subprocess.run(["sox", raw, "-r", str(SR), "-c", "1", "-b", "16", out], check=True, capture_output=True)
        x, sr = sf.read(out, dtype="float32")
    else:  # sox missing: resample with soxr (a glmasr dependency) instead
        import soxr

        x, sr = sf.read(raw, dtype="float32")
        x = soxr.resample(x, sr, SR).astype(np.float32)
        sr = SR
    assert sr == SR
    return x


def _extent(x: np.ndarray, rel_db: float = -40.0) -> tuple[float, float]:
    """First and last 10 ms frame within ``rel_db`` of the clip's loudest frame: where the speech is in a clip
    (espeak-ng puts a little silence around it)."""
    f = SR // 100
    n = len(x) // f
    rms = np.sqrt((x[: n * f].reshape(n, f).astype(np.float64) ** 2).mean(1) + 1e-20)
    active = np.nonzero(20 * np.log10(rms / rms.max()) > rel_db)[0]
    return active[0] * f / SR, (active[-1] + 1) * f / SR


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (Debian: apt-get install -y espeak-ng sox); the speech tests need it")
    tmp = str(tmp_path_factory.mktemp("espeak"))
    out = []
    for text in SENTENCES:
        x = 0.5 * _synthesize(text, tmp)
        out.append((x, _extent(x)))
    return out


def _place(clips, seconds: float, seed: int, gap=(1.0, 4.0), first: float = 1.37):
    """Clips one after another at random gaps (not window aligned) into ``seconds`` of low noise.
    Returns the recording and the true speech intervals [(start_s, end_s)] in it."""
    rng = np.random.default_rng(seed)
    rec = (rng.standard_normal(int(seconds * SR)) * NOISE).astype(np.float32)
    truth = []
    pos = first
    while True:
        x, (a, b) = clips[int(rng.integers(len(clips)))]
        if pos + len(x) / SR > seconds - 1.0:
            break
        i = int(round(pos * SR))
        rec[i:i + len(x)] += x
        truth.append((i / SR + a, i / SR + b))
        pos = (i + len(x)) / SR + float(rng.uniform(*gap))
    return rec, truth


@pytest.fixture(scope="module")
def short_recording(clips):
    return _place(clips, 40.0, seed=1)


@pytest.fixture(scope="module")
def long_recording(clips):
    """Six minutes: 12 streams of 30 s, stream boundaries inside and outside speech."""
    return _place(clips, 360.0, seed=3, gap=(0.6, 4.0))


# -- the network against onnxruntime --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def onnx_session():
    ort = pytest.importorskip("onnxruntime")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(vad.data_file("silero_vad.onnx")), opts, providers=["CPUExecutionProvider"])


def _onnx_stream(sess, audio: np.ndarray) -> np.ndarray:
    """The ONNX model window by window over (N, T * 512) audio, N streams as one batch, state and context carried
    (as silero-vad's own wrapper feeds it). Returns probabilities (N, T)."""
    n, total = audio.shape
    state = np.zeros((2, n, 128), np.float32)
    ctx = np.zeros((n, vad.CONTEXT), np.float32)
    sr = np.array(SR, dtype=np.int64)
    out = []
    for t in range(total // vad.WINDOW):
        x = np.concatenate([ctx, audio[:, t * vad.WINDOW:(t + 1) * vad.WINDOW]], axis=1)
        p, state = sess.run(None, {"input": x, "state": state, "sr": sr})
        ctx = x[:, -vad.CONTEXT:]
        out.append(p[:, 0])
    return np.stack(out, axis=1)


def test_forward_matches_onnx_random_audio_batched_streams(onnx_session):
    """4 independent streams of fresh random audio as one batch, 400 windows with the state carried: our module's
    forward (the ONNX interface) and the whole-recording path, each stream on its own."""
    rng = np.random.default_rng(0)
    n, t = 4, 400
    audio = (rng.standard_normal((n, t * vad.WINDOW)) * rng.uniform(0.01, 0.3, (n, 1))).astype(np.float32)
    ref = _onnx_stream(onnx_session, audio)
    model = vad.load_vad("cpu")
    state = torch.zeros(2, n, 128)
    ctx = torch.zeros(n, vad.CONTEXT)
    ours = []
    with torch.inference_mode():
        for i in range(t):
            x = torch.cat([ctx, torch.from_numpy(audio[:, i * vad.WINDOW:(i + 1) * vad.WINDOW])], dim=1)
            p, state = model(x, state)
            ctx = x[:, -vad.CONTEXT:]
            ours.append(p[:, 0].numpy())
    ours = np.stack(ours, axis=1)
    assert np.abs(ours - ref).max() <= PROB_ATOL, np.abs(ours - ref).max()
    for k in range(n):
        whole = vad.speech_probabilities(audio[k], device="cpu", streams=1)
        assert whole.shape == (t,)
        assert np.abs(whole - ref[k]).max() <= PROB_ATOL


def test_probabilities_match_onnx_on_speech(onnx_session, short_recording):
    rec, truth = short_recording
    n_win = len(rec) // vad.WINDOW  # 1250 windows
    rec = rec[: n_win * vad.WINDOW]
    ref = _onnx_stream(onnx_session, rec[None])[0]
    ours = vad.speech_probabilities(rec, device="cpu", streams=1)
    err = np.abs(ours - ref).max()
    print(f"\nmax |ours - onnxruntime| over {n_win} windows of speech: {err:.2e}")
    assert err <= PROB_ATOL
    assert ref.max() > 0.9 and ref.min() < 0.1  # the recording does have speech and silence


def test_matmul_front_end_matches_onnx(onnx_session):
    """The front end as matmuls (what CUDA runs, to stay fp32 where cuDNN would use TF32), here on the CPU."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((64, vad.CONTEXT + vad.WINDOW)) * 0.2).astype(np.float32)
    state = (rng.standard_normal((2, 64, 128)) * 0.5).astype(np.float32)
    ref, ref_state = onnx_session.run(None, {"input": x, "state": state, "sr": np.array(SR, dtype=np.int64)})
    model = vad.load_vad("cpu")
    with torch.inference_mode():
        feats = model.encode(torch.from_numpy(x), as_matmul=True)
        assert torch.allclose(feats, model.encode(torch.from_numpy(x), as_matmul=False), atol=1e-4, rtol=1e-5)
        st = torch.from_numpy(state)
        h, c = model.cell(model.input_gates(feats), st[0], st[1])
        p = model.decode(h)
    assert np.abs(p.numpy() - ref[:, 0]).max() <= PROB_ATOL
    assert np.abs(torch.stack([h, c]).numpy() - ref_state).max() <= 1e-4


def test_safetensors_weights_are_not_the_onnx_ones():
    """The wheel's safetensors file has our names and shapes but older values; the default source is the
    TorchScript model, whose tensors are the ONNX model's (the tests above)."""
    st = vad.load_weights("safetensors")
    jit = vad.load_weights("jit")
    assert st.keys() == jit.keys()
    assert all(st[k].shape == jit[k].shape for k in st)
    assert torch.equal(st["stft_conv.weight"], jit["stft_conv.weight"])
    assert not torch.allclose(st["conv1.weight"], jit["conv1.weight"])
    with pytest.raises(ValueError, match="unknown weights source"):
        vad.load_weights("pickle")


# -- regions -------------------------------------------------------------------------------------------------
def test_regions_where_the_speech_was_put(short_recording):
    rec, truth = short_recording
    found = vad.speech_regions(rec, device="cpu", streams=1, speech_pad_ms=0)
    assert len(found) == len(truth), (found, truth)
    for (a, b), (ta, tb) in zip(found, truth):
        assert abs(a - ta) <= TOL_S and abs(b - tb) <= TOL_S, ((a, b), (ta, tb))
    # With padding (default 200 ms): widened on both sides, clipped to the recording.
    pad = 0.2
    padded = vad.speech_regions(rec, device="cpu", streams=1)
    assert len(padded) == len(found)
    for (a, b), (fa, fb) in zip(padded, found):
        assert a == pytest.approx(max(0.0, fa - pad), abs=1e-6) and b == pytest.approx(fb + pad, abs=1e-6)


def test_silence_and_noise_have_no_regions():
    rng = np.random.default_rng(5)
    assert vad.speech_regions(np.zeros(SR * 10, np.float32), device="cpu") == []
    assert vad.speech_regions((rng.standard_normal(SR * 10) * NOISE).astype(np.float32), device="cpu") == []
    assert vad.speech_regions(np.zeros(100, np.float32), device="cpu") == []  # shorter than one window


def test_region_rules_on_given_probabilities():
    w = vad.WINDOW_S
    p = np.zeros(400, np.float32)
    p[10:40] = 0.9  # 0.96 s of speech
    p[40:45] = 0.1  # a 160 ms dip: shorter than min_silence, stays inside the region
    p[45:60] = 0.9
    p[60:62] = 0.45  # between the thresholds: the region ends here (where it went below 0.5), minus one window
    p[100:104] = 0.9  # 128 ms: shorter than min_speech (250 ms), dropped
    p[200:230] = 0.9
    p[245:300] = 0.9  # 15 windows (480 ms) of silence before it: < 500 ms, joined to the region before
    p[390:400] = 0.9  # runs to the end
    got = vad.regions_from_probabilities(p, speech_pad_ms=0)
    np.testing.assert_allclose(got, [(10 * w, 59 * w), (200 * w, 299 * w), (390 * w, 400 * w)])  # vad._END_LAG
    # two regions 640 ms apart with 400 ms pads share the gap half and half
    q = np.zeros(200, np.float32)
    q[20:40] = 0.9
    q[60:80] = 0.9  # 20 windows (640 ms) apart
    got = vad.regions_from_probabilities(q, speech_pad_ms=400, min_silence_ms=300)
    mid = (39 * w + 60 * w) / 2
    assert got[0] == pytest.approx((20 * w - 0.4, mid)) and got[1] == pytest.approx((mid, 79 * w + 0.4))


def test_batched_streams_equal_single_stream(long_recording):
    rec, truth = long_recording
    t0 = time.perf_counter()
    single_p = vad.speech_probabilities(rec, device="cpu", streams=1)
    t1 = time.perf_counter()
    batched_p = vad.speech_probabilities(rec, device="cpu", streams=12)  # 30 s each
    t2 = time.perf_counter()
    single = vad.regions_from_probabilities(single_p, len(rec), speech_pad_ms=0)
    batched = vad.regions_from_probabilities(batched_p, len(rec), speech_pad_ms=0)
    print(f"\n6 min, CPU: one stream {t1 - t0:.2f} s, 12 streams {t2 - t1:.2f} s; "
          f"max |p_batched - p_single| = {np.abs(batched_p - single_p).max():.1e}")
    assert len(batched) == len(single) == len(truth)
    for (a, b), (c, d) in zip(batched, single):
        assert abs(a - c) <= TOL_S and abs(b - d) <= TOL_S
    for (a, b), (ta, tb) in zip(single, truth):
        assert abs(a - ta) <= TOL_S and abs(b - tb) <= TOL_S
    # A fixed number of passes: after p passes the first p streams are exact.
    two = vad.speech_probabilities(rec, device="cpu", streams=12, passes=2)
    stream = -(-len(single_p) // 12)
    assert np.abs(two[: 2 * stream] - single_p[: 2 * stream]).max() <= PROB_ATOL
    exact = vad.speech_probabilities(rec[: 2812 * vad.WINDOW], device="cpu", streams=3, passes=3)  # 90 s
    assert np.abs(exact - single_p[: len(exact)]).max() <= PROB_ATOL


# -- merging -------------------------------------------------------------------------------------------------
def _check_pieces(pieces, regions, max_s):
    for a, b in pieces:
        assert 0 < b - a <= max_s + 1e-9
    for (_, b), (c, _) in zip(pieces, pieces[1:]):
        assert b <= c + 1e-9  # in order, not overlapping
    for a, b in regions:  # every bit of speech is inside the pieces
        inside = sum(max(0.0, min(b, d) - max(a, c)) for c, d in pieces)
        assert inside == pytest.approx(b - a, abs=1e-6)


def test_merge_regions_on_speech(long_recording):
    rec, _ = long_recording
    probs = vad.speech_probabilities(rec, device="cpu", streams=12)
    regions = vad.regions_from_probabilities(probs, len(rec))
    pieces = vad.merge_regions(regions, max_s=30.0, probs=probs)
    _check_pieces(pieces, regions, 30.0)
    assert len(pieces) < len(regions)  # neighbours were merged
    assert pieces == vad.segment(rec, device="cpu", streams=12)
    assert all(b - a > 15.0 for a, b in pieces[:-1])  # greedy: a piece ends only when the next region won't fit
    gapped = vad.merge_regions(regions, max_s=30.0, max_gap_s=2.0)
    _check_pieces(gapped, regions, 30.0)
    assert len(gapped) > len(pieces)


def test_merge_splits_long_regions():
    w = vad.WINDOW_S
    # one 75 s region, probabilities with a dip at 22 s and one at 50 s
    p = np.full(int(80 / w), 0.95, np.float32)
    p[int(22 / w)] = 0.2
    p[int(50 / w)] = 0.3
    region = [(1.0, 76.0)]
    pieces = vad.merge_regions(region, max_s=30.0, probs=p)
    _check_pieces(pieces, region, 30.0)
    assert [round(b, 3) for _, b in pieces[:-1]] == [round(int(22 / w) * w, 3), round(int(50 / w) * w, 3)]
    hard = vad.merge_regions(region, max_s=30.0)
    assert hard == [(1.0, 31.0), (31.0, 61.0), (61.0, 76.0)]
    # short regions merge up to max_s, long gaps included
    assert vad.merge_regions([(0.0, 5.0), (20.0, 29.0), (31.0, 33.0)], max_s=30.0) == [(0.0, 29.0), (31.0, 33.0)]
    assert vad.merge_regions([]) == []
    with pytest.raises(ValueError):
        vad.merge_regions(region, max_s=0)


# -- packaging ------------------------------------------------------------------------------------------------
def test_missing_wheel_names_the_extra(monkeypatch):
    import importlib.metadata as md

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "distribution", missing)
    vad._cached_model.cache_clear()
    try:
        with pytest.raises(vad.VadUnavailableError, match=r"pip install glmasr\[vad\]") as e:
            vad.speech_regions(np.zeros(SR, np.float32), device="cpu")
        assert isinstance(e.value, ImportError) and "silero-vad" in str(e.value)
    finally:
        vad._cached_model.cache_clear()


def test_silero_vad_package_is_not_imported():
    code = ("import sys, torch, numpy as np; torch.set_num_threads(2); from glmasr.audio import vad; "
            "vad.speech_regions(np.zeros(16000, np.float32), device='cpu'); "
            "assert 'silero_vad' not in sys.modules, 'silero_vad imported'; "
            "assert torch.get_num_threads() == 2, torch.get_num_threads()")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_inputs():
    with pytest.raises(ValueError, match="1-D"):
        vad.speech_regions(np.zeros((2, SR), np.float32), device="cpu")
    with pytest.raises(ValueError, match="float"):
        vad.speech_regions(np.zeros(SR, np.int16), device="cpu")
    with pytest.raises(ValueError, match="streams"):
        vad.speech_probabilities(np.zeros(SR, np.float32), device="cpu", streams=0)


# -- devices and speed --------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the H200 via scripts/device.sh)")
def test_cuda_matches_cpu(long_recording):
    rec, _ = long_recording
    cpu1 = vad.speech_probabilities(rec, device="cpu", streams=1)
    gpu1 = vad.speech_probabilities(rec, device="cuda", streams=1)
    assert np.abs(gpu1 - cpu1).max() <= 1e-4  # TF32 is off for fp32 matmuls by default; cuBLAS order differs
    gpu = vad.speech_probabilities(rec, device="cuda")
    single = vad.regions_from_probabilities(cpu1, len(rec), speech_pad_ms=0)
    batched = vad.regions_from_probabilities(gpu, len(rec), speech_pad_ms=0)
    assert len(single) == len(batched)
    assert all(abs(a - c) <= TOL_S and abs(b - d) <= TOL_S for (a, b), (c, d) in zip(batched, single))
    hour = np.tile(rec, 10)
    vad.speech_probabilities(hour[: 60 * SR], device="cuda")  # warm
    torch.cuda.synchronize()
    t = time.perf_counter()
    pieces = vad.segment(hour, device="cuda")
    print(f"\n1 h of audio segmented on {torch.cuda.get_device_name()}: {time.perf_counter() - t:.2f} s, "
          f"{len(pieces)} pieces")


def test_lstm_kernel_path_on_cpu_interpreter(monkeypatch):
    """The Triton recurrence wired into speech_probabilities (keep mask, state handed between passes, the
    one-stream path), run on the CPU under Triton's interpreter with the real weights, against the torch loop.
    Only under TRITON_INTERPRET=1 (CI); on a GPU test_cuda_lstm_kernel_matches_torch_loop covers it."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs TRITON_INTERPRET=1 (the kernel on the CPU)")
    lstm_cell = pytest.importorskip("glmasr_kernels.lstm_cell")
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(4 * SR) * np.repeat(rng.uniform(0.01, 0.3, 8), SR // 2)).astype(np.float32)
    ref2 = vad.speech_probabilities(x, device="cpu", streams=2, passes=2, warmup_s=0.5)
    ref1 = vad.speech_probabilities(x[: SR], device="cpu", streams=1)
    calls = []
    monkeypatch.setattr(vad, "_lstm_kernel", lambda device: calls.append(device) or lstm_cell.lstm_sequence)
    got2 = vad.speech_probabilities(x, device="cpu", streams=2, passes=2, warmup_s=0.5)
    got1 = vad.speech_probabilities(x[: SR], device="cpu", streams=1)
    assert len(calls) == 3
    assert np.abs(got2 - ref2).max() <= PROB_ATOL and np.abs(got1 - ref1).max() <= PROB_ATOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the H200 via scripts/device.sh)")
def test_cuda_lstm_kernel_matches_torch_loop(long_recording, monkeypatch):
    """The Triton recurrence (default on CUDA) against the torch loop (the reference), both on CUDA: the same
    probabilities within fp32 rounding carried through the recurrence (1e-4, as CUDA vs CPU above) and the
    same regions and pieces; then the time of an hour with each."""
    pytest.importorskip("triton")
    rec, _ = long_recording
    assert vad._lstm_kernel(torch.device("cuda")) is not None
    kernel = {k: vad.speech_probabilities(rec, device="cuda", streams=k) for k in (None, 1)}
    monkeypatch.setattr(vad, "TRITON_LSTM", False)
    assert vad._lstm_kernel(torch.device("cuda")) is None
    loop = {k: vad.speech_probabilities(rec, device="cuda", streams=k) for k in (None, 1)}
    for k in kernel:
        err = np.abs(kernel[k] - loop[k]).max()
        print(f"\nstreams={k}: max |p_kernel - p_torch| = {err:.1e}")
        assert err <= 1e-4
        for pad in (0, 200):
            assert vad.regions_from_probabilities(kernel[k], len(rec), speech_pad_ms=pad) == \
                vad.regions_from_probabilities(loop[k], len(rec), speech_pad_ms=pad)
    hour = np.tile(rec, 10)
    times = {}
    for on in (False, True):
        monkeypatch.setattr(vad, "TRITON_LSTM", on)
        vad.speech_probabilities(hour[: 60 * SR], device="cuda")  # warm (and compile)
        torch.cuda.synchronize()
        t = time.perf_counter()
        times[on] = (vad.segment(hour, device="cuda"), time.perf_counter() - t)
    assert times[True][0] == times[False][0]
    print(f"1 h segmented on {torch.cuda.get_device_name()}: torch loop {times[False][1]:.3f} s, "
          f"Triton kernel {times[True][1]:.3f} s")


def test_cpu_timing_ten_minutes(long_recording, capsys):
    """Not an assertion: how long 10 minutes of audio take to segment on this CPU (default: one stream)."""
    rec, _ = long_recording
    ten = np.concatenate([rec, rec[: 240 * SR]])
    vad.load_vad("cpu")
    t = time.perf_counter()
    pieces = vad.segment(ten, device="cpu")
    el = time.perf_counter() - t
    with capsys.disabled():
        print(f"\n10 min of audio segmented on the CPU ({torch.get_num_threads()} threads): {el:.2f} s "
              f"({600 / el:.0f}x real time), {len(pieces)} pieces")
