"""Audio input: formats, rates, channels, PCM types, and clear errors for bad input."""

import numpy as np
import pytest
import soundfile as sf
import torch

import glmasr
from glmasr.audio import AudioError, load_audio, split_windows

from conftest import noise


def tone(seconds, rate, freq=440.0):
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.mark.parametrize("ext, subtype", [("wav", "PCM_16"), ("wav", "FLOAT"), ("flac", "PCM_16"), ("flac", "PCM_24")])
def test_file_formats_at_16k(tmp_path, ext, subtype):
    x = noise(1.5, 7, scale=0.2)
    path = tmp_path / f"a.{ext}"
    sf.write(path, x, 16000, subtype=subtype)
    a = load_audio(str(path))
    assert a.samples.dtype == np.float32 and a.samples.shape == x.shape
    # 16-bit quantisation step is 1/32768 ~ 3e-5; 24-bit and float are finer.
    np.testing.assert_allclose(a.samples, x, atol=4e-5)


@pytest.mark.parametrize("rate", [8000, 44100])
def test_resampled_to_16k(tmp_path, rate):
    path = tmp_path / f"tone_{rate}.wav"
    sf.write(path, tone(2.0, rate), rate, subtype="PCM_16")
    a = load_audio(path)
    assert abs(a.samples.shape[0] - 32000) <= 1
    expected = tone(2.0, 16000)
    # A band-limited resampler reproduces a 440 Hz tone to ~1e-3 away from the edges.
    np.testing.assert_allclose(a.samples[800:-800], expected[800:-800], atol=2e-3)


def test_stereo_is_averaged_to_mono(tmp_path):
    left, right = noise(1.0, 1), noise(1.0, 2)
    path = tmp_path / "stereo.flac"
    sf.write(path, np.stack([left, right], axis=1), 16000, subtype="PCM_24")
    a = load_audio(path)
    np.testing.assert_allclose(a.samples, (left + right) / 2, atol=1e-6)
    # arrays in either (samples, channels) or (channels, samples) orientation
    both = np.stack([left, right])
    np.testing.assert_allclose(load_audio(both, 16000).samples, (left + right) / 2, atol=1e-7)
    np.testing.assert_allclose(load_audio(both.T.copy(), 16000).samples, (left + right) / 2, atol=1e-7)


def test_int16_arrays_tensors_and_files_agree(tmp_path):
    pcm = (noise(1.0, 3, scale=0.3) * 32767).astype(np.int16)
    path = tmp_path / "int16.wav"
    sf.write(path, pcm, 16000, subtype="PCM_16")
    from_file = load_audio(path).samples
    from_numpy = load_audio(pcm, 16000).samples
    from_torch = load_audio(torch.from_numpy(pcm), 16000).samples
    np.testing.assert_array_equal(from_numpy, pcm.astype(np.float32) / 32768)
    np.testing.assert_array_equal(from_file, from_numpy)
    np.testing.assert_array_equal(from_torch, from_numpy)


def test_windows_split_like_the_reference():
    x = noise(70.0, 9)
    wins = split_windows(x)
    assert [w.shape[0] for w in wins] == [480000, 480000, 160000]
    assert np.array_equal(np.concatenate(wins), x)


def test_missing_file(tmp_path):
    with pytest.raises(AudioError, match="not found.*nope.wav"):
        load_audio(tmp_path / "nope.wav")


def test_corrupt_file(tmp_path):
    path = tmp_path / "broken.wav"
    path.write_bytes(b"RIFF\x00\x00\x00\x00WAVEgarbage" + bytes(100))
    with pytest.raises(AudioError, match="cannot decode.*broken.wav"):
        load_audio(path)


def test_empty_audio(tmp_path):
    path = tmp_path / "empty.wav"
    sf.write(path, np.zeros(0, dtype=np.float32), 16000)
    with pytest.raises(AudioError, match="empty"):
        load_audio(path)
    with pytest.raises(AudioError, match="empty"):
        load_audio(np.zeros(0, dtype=np.float32), 16000)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_samples(bad):
    x = noise(1.0, 4)
    x[100] = bad
    with pytest.raises(AudioError, match="NaN or infinite"):
        load_audio(x, 16000)


def test_array_needs_sampling_rate_and_a_sane_one():
    with pytest.raises(AudioError, match="sampling_rate"):
        load_audio(noise(1.0, 5))
    with pytest.raises(AudioError, match="sampling_rate"):
        load_audio(noise(1.0, 5), 0)
    with pytest.raises(AudioError, match="sampling_rate"):
        load_audio(noise(1.0, 5), 16000.5)


def test_file_rate_mismatch_is_an_error(tmp_path):
    path = tmp_path / "a.wav"
    sf.write(path, noise(1.0, 6), 16000)
    with pytest.raises(AudioError, match="16000 Hz but sampling_rate=8000"):
        load_audio(path, 8000)


def test_too_short_for_one_audio_token(tiny_asr):
    with pytest.raises(AudioError, match="too short.*961 samples"):
        glmasr.transcribe(noise(0.05, 1), model=tiny_asr, sampling_rate=16000)
    # 961 samples is exactly enough
    r = glmasr.transcribe(noise(961 / 16000, 2), model=tiny_asr, sampling_rate=16000, max_new_tokens=2)
    assert r.num_audio_tokens == 1


def test_unsupported_input_type(tiny_asr):
    with pytest.raises(AudioError, match="unsupported audio input type"):
        glmasr.transcribe(12345, model=tiny_asr)


@pytest.mark.parametrize("fmt, subtype, rate", [("MP3", "MPEG_LAYER_III", 44100), ("OGG", "VORBIS", 16000),
                                                ("OGG", "OPUS", 48000)])
def test_compressed_formats(tmp_path, fmt, subtype, rate):
    """Lossy files decode through libsndfile and resample to 16 kHz; a lossy codec changes the waveform, so
    the check is duration and a high correlation with the source tone."""
    path = tmp_path / f"a.{fmt.lower()}"
    sf.write(path, tone(2.0, rate, freq=300.0), rate, format=fmt, subtype=subtype)
    a = load_audio(path)
    expected = tone(2.0, 16000, freq=300.0)
    assert abs(a.samples.shape[0] - expected.shape[0]) <= 0.06 * 16000  # codec priming / padding
    n = min(a.samples.shape[0], expected.shape[0])
    # find the codec delay, then compare shapes by correlation
    best = max(np.corrcoef(a.samples[d:d + n - 2000], expected[:n - 2000])[0, 1] for d in range(0, 1200, 8))
    assert best > 0.95


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=["bf16", "fp16", "fp64"])
def test_half_precision_tensors_are_converted(dtype):
    """bf16 has no numpy type (``.numpy()`` raises a TypeError naming no input); fp16/fp64 go through numpy.
    All become float32 of exactly the tensor's values (every bf16/fp16 value is exact in float32)."""
    x = torch.from_numpy(noise(1.0, 11, scale=0.3)).to(dtype)
    a = load_audio(x, 16000)
    assert a.samples.dtype == np.float32 and a.samples.shape == (16000,)
    np.testing.assert_array_equal(a.samples, x.to(torch.float32).numpy())
    # channels and resampling work on the converted samples too
    stereo = torch.stack([x, x])
    np.testing.assert_array_equal(load_audio(stereo, 16000).samples, a.samples)
    assert abs(load_audio(x, 8000).samples.shape[0] - 32000) <= 1


def test_numpy_float16_is_converted():
    x = noise(1.0, 12, scale=0.3).astype(np.float16)
    a = load_audio(x, 16000)
    assert a.samples.dtype == np.float32
    np.testing.assert_array_equal(a.samples, x.astype(np.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device)")
def test_bf16_cuda_tensor_is_converted():
    x = torch.from_numpy(noise(1.0, 13, scale=0.3)).to("cuda", torch.bfloat16)
    np.testing.assert_array_equal(load_audio(x, 16000).samples, x.float().cpu().numpy())


@pytest.mark.parametrize("make, dtype_name", [
    (lambda: torch.randn(1000, dtype=torch.complex64), "torch.complex64"),
    (lambda: torch.zeros(1000, dtype=torch.bool), "torch.bool"),
    (lambda: np.zeros(1000, dtype=np.complex128), "complex128"),
    (lambda: np.ones(1000, dtype=np.bool_), "bool"),
    (lambda: np.array([0.1] * 999 + [None], dtype=object), "object"),
    (lambda: np.array(["a"] * 1000), "<U1"),
    (lambda: np.zeros(1000, dtype=np.uint16), "uint16"),
], ids=["torch-complex", "torch-bool", "numpy-complex", "numpy-bool", "numpy-object", "numpy-str", "numpy-uint16"])
def test_unsupported_dtypes_name_input_and_dtype(make, dtype_name):
    data = make()
    with pytest.raises(AudioError) as e:
        load_audio(data, 16000, source="audio 2")
    msg = str(e.value)
    assert msg.startswith("audio 2 (") and f"dtype {dtype_name}" in msg, msg
    assert "unsupported sample dtype" in msg, msg
    with pytest.raises(AudioError, match=rf"^{type(data).__name__} of shape \(1000,\), dtype "):
        load_audio(data, 16000)  # without a source: the description names it


def test_source_names_files_and_other_errors(tmp_path):
    with pytest.raises(AudioError, match=r"^clip 0: audio file not found: .*nope\.wav"):
        load_audio(tmp_path / "nope.wav", source="clip 0")
    path = tmp_path / "a.wav"
    sf.write(path, noise(1.0, 6), 16000)
    with pytest.raises(AudioError, match=r"^clip 1 \(.*a\.wav\): file is 16000 Hz"):
        load_audio(path, 8000, source="clip 1")
    assert load_audio(path, source="clip 1").source == f"clip 1 ({path})"
    x = noise(1.0, 4)
    x[3] = np.nan
    with pytest.raises(AudioError, match=r"^clip 2 \(ndarray of shape \(16000,\), dtype float32\): audio has 1 NaN"):
        load_audio(x, 16000, source="clip 2")
    with pytest.raises(AudioError, match=r"^clip 3: unsupported audio input type list"):
        load_audio([0.0, 0.1], 16000, source="clip 3")


def test_transcribe_accepts_a_bf16_tensor(tiny_asr):
    x = torch.from_numpy(noise(2.0, 14)).to(torch.bfloat16)
    a = glmasr.transcribe(x, model=tiny_asr, sampling_rate=16000, max_new_tokens=3)
    b = glmasr.transcribe(x.float(), model=tiny_asr, sampling_rate=16000, max_new_tokens=3)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 3
