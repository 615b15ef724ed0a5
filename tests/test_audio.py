"""Audio input: formats, rates, channels, PCM types, and clear errors for bad input."""

import io
import sys

import numpy as np
import pytest
import soundfile as sf
import torch

import glmasr
from glmasr.audio import AudioError, load_audio, split_windows

from conftest import noise, pyav_encode


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


# ------------------------------------------------------------------------------------ truncated files

import struct  # noqa: E402
import warnings  # noqa: E402

from glmasr.audio import decode as audio_mod  # noqa: E402
from glmasr.audio import resampler as rs_mod  # noqa: E402
from glmasr.audio import Audio, AudioWarning, read_file, resample  # noqa: E402


def _cut(src, dst, fraction=None, nbytes=None):
    data = src.read_bytes()
    dst.write_bytes(data[:nbytes if nbytes is not None else int(len(data) * fraction)])
    return dst


def _warned(fn, *args, **kw):
    """fn(*args, **kw) with every warning recorded: (its Audio, [AudioWarning messages])."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = fn(*args, **kw)
    return a, [str(w.message) for w in caught if issubclass(w.category, AudioWarning)]


def _load_warned(path, **kw):
    return _warned(load_audio, path, **kw)


def test_audio_keeps_its_two_field_construction():
    a = Audio(np.zeros(1600, np.float32), "x")
    assert a.truncated is False and a.expected_duration_s is None and a.missing_s == 0.0 and a.duration_s == 0.1


@pytest.mark.parametrize("subtype, bytes_per_frame", [("PCM_16", 2), ("PCM_24", 3), ("FLOAT", 4)])
@pytest.mark.parametrize("fraction", [0.9, 0.5, 0.153, 0.02])
def test_truncated_wav_warns_and_says_so(tmp_path, subtype, bytes_per_frame, fraction):
    """The issue's case: a WAV cut short (its data chunk runs past the end of the file) used to decode to what was
    there with no word. Now: the samples that are there, one AudioWarning naming the file and what is missing."""
    x = noise(5.94, 21, scale=0.2)
    full = tmp_path / "full.wav"
    sf.write(full, x, 16000, subtype=subtype)
    cut = _cut(full, tmp_path / "cut.wav", fraction)
    a, msgs = _load_warned(cut)
    header = full.read_bytes().index(b"data") + 8  # 44 bytes for PCM; float WAVs have a fact chunk too
    present = (cut.stat().st_size - header) // bytes_per_frame
    assert a.samples.shape == (present,)
    np.testing.assert_allclose(a.samples, x[:present], atol=4e-5)
    assert a.truncated and a.expected_duration_s == pytest.approx(5.94)
    assert a.missing_s == pytest.approx(5.94 - present / 16000, abs=1e-6)
    assert len(msgs) == 1, msgs
    assert str(cut) in msgs[0] and "header declares 5.94 s" in msgs[0]
    assert f"{present / 16000:.2f} s could be decoded ({5.94 - present / 16000:.2f} s missing)" in msgs[0]


def test_truncated_wav_mid_sample_and_in_the_header(tmp_path):
    full = tmp_path / "full.wav"
    sf.write(full, noise(2.0, 22), 16000, subtype="PCM_16")
    a, msgs = _load_warned(_cut(full, tmp_path / "odd.wav", nbytes=44 + 2 * 1000 + 1))  # half a sample at the end
    assert a.samples.shape == (1000,) and a.truncated and len(msgs) == 1
    with pytest.raises(AudioError, match=r"nothing could be decoded.*header declares 2.00 s"):
        load_audio(_cut(full, tmp_path / "nodata.wav", nbytes=44))  # the header and no samples
    with pytest.raises(AudioError, match="cannot decode.*hdr.wav"):
        load_audio(_cut(full, tmp_path / "hdr.wav", nbytes=30))  # cut inside the fmt chunk


def test_wav_with_a_streaming_placeholder_size_is_not_truncated(tmp_path):
    """Writers to a pipe cannot go back to fill in the sizes and leave 0xFFFFFFFF: no length is declared."""
    path = tmp_path / "stream.wav"
    x = noise(1.0, 23)
    sf.write(path, x, 16000, subtype="PCM_16")
    data = bytearray(path.read_bytes())
    assert data[36:40] == b"data"
    data[4:8] = struct.pack("<I", 0xFFFFFFFF)
    data[40:44] = struct.pack("<I", 0xFFFFFFFF)
    path.write_bytes(bytes(data))
    a, msgs = _load_warned(path)
    assert not msgs and not a.truncated and a.expected_duration_s is None
    np.testing.assert_allclose(a.samples, x, atol=4e-5)


@pytest.mark.parametrize("subtype", ["PCM_16", "PCM_24"])
@pytest.mark.parametrize("fraction", [0.9, 0.5, 0.2])
def test_truncated_flac_keeps_what_decodes(tmp_path, subtype, fraction):
    """A cut FLAC fails part-way in libsndfile; what precedes the damage is kept (to within a FLAC frame, 4096
    samples), the STREAMINFO count says how much is missing."""
    x = noise(5.94, 24, scale=0.2)
    full = tmp_path / "full.flac"
    sf.write(full, x, 16000, subtype=subtype)
    cut = _cut(full, tmp_path / "cut.flac", fraction)
    a, msgs = _load_warned(cut)
    n = a.samples.shape[0]
    assert 0 < n < x.shape[0] and a.truncated and a.expected_duration_s == pytest.approx(5.94)
    assert n >= 0.8 * fraction * x.shape[0] - 4096  # nearly all of what the bytes hold (compression is even here)
    np.testing.assert_allclose(a.samples, x[:n], atol=4e-5)
    assert len(msgs) == 1 and str(cut) in msgs[0] and "header declares 5.94 s" in msgs[0], msgs
    assert f"({5.94 - n / 16000:.2f} s missing)" in msgs[0]


def test_flac_cut_before_its_first_frame(tmp_path):
    full = tmp_path / "full.flac"
    sf.write(full, noise(5.94, 25), 16000)
    with pytest.raises(AudioError, match=r"^.*early\.flac: audio is empty: nothing could be decoded.*5\.94 s"):
        load_audio(_cut(full, tmp_path / "early.flac", 0.02))


def test_truncated_mp3_with_a_xing_header(tmp_path):
    full = tmp_path / "full.mp3"
    sf.write(full, tone(5.94, 44100), 44100, format="MP3", subtype="MPEG_LAYER_III")
    a, msgs = _load_warned(_cut(full, tmp_path / "cut.mp3", 0.5))
    assert a.truncated and a.expected_duration_s == pytest.approx(5.94) and 2.5 < a.duration_s < 3.2
    assert len(msgs) == 1 and "cut.mp3" in msgs[0] and "s missing" in msgs[0]


@pytest.mark.parametrize("fmt, subtype, ext", [("WAV", "PCM_16", "wav"), ("WAV", "FLOAT", "wav"),
                                               ("FLAC", "PCM_24", "flac"), ("MP3", "MPEG_LAYER_III", "mp3"),
                                               ("OGG", "VORBIS", "ogg"), ("OGG", "OPUS", "opus")])
def test_complete_files_do_not_warn(tmp_path, fmt, subtype, ext):
    rate = 48000 if subtype == "OPUS" else 16000
    path = tmp_path / f"a.{ext}"
    sf.write(path, tone(2.5, rate), rate, format=fmt, subtype=subtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AudioWarning)
        a = load_audio(path)
    assert not a.truncated and a.expected_duration_s == pytest.approx(2.5)


def test_read_file_warns_too(tmp_path):
    full = tmp_path / "full.wav"
    sf.write(full, noise(2.0, 26), 16000)
    with pytest.warns(AudioWarning, match=r"cut\.wav: truncated audio file: its header declares 2\.00 s"):
        data, rate = read_file(_cut(full, tmp_path / "cut.wav", 0.5))
    assert rate == 16000 and data.ndim == 1 and 15000 < data.shape[0] < 17000


def test_source_label_leads_the_warning(tmp_path):
    full = tmp_path / "full.wav"
    sf.write(full, noise(2.0, 27), 16000)
    _, msgs = _load_warned(_cut(full, tmp_path / "cut.wav", 0.5), source="clip 4")
    assert len(msgs) == 1 and msgs[0].startswith(f"clip 4 ({tmp_path / 'cut.wav'}): truncated audio file")


# ------------------------------------------------------------------- containers through PyAV (FFmpeg)


def _encode(path, fmt, codec, rate, seconds, freq=440.0, channels=1, options=None):
    """Encode a sine with PyAV itself: AAC in mp4/m4a/adts, Opus in webm. Returns the mono source signal."""
    pytest.importorskip("av")
    x = tone(seconds, rate, freq)
    pyav_encode(np.repeat(x[:, None], channels, 1), rate, fmt, codec, "mono" if channels == 1 else "stereo",
                path=path, options=options)
    return x


CONTAINERS = [  # name, muxer, codec, rate, channels, muxer options, codec frame (samples), frames of slack
    ("a.mp4", "mp4", "aac", 44100, 2, None, 1024, 1),
    ("a.m4a", "ipod", "aac", 48000, 1, None, 1024, 1),
    ("fast.m4a", "ipod", "aac", 16000, 1, {"movflags": "faststart"}, 1024, 1),
    # ADTS has no place for the encoder delay: FFmpeg's 1024 priming samples stay in, plus the last frame's padding
    ("a.aac", "adts", "aac", 44100, 1, None, 1024, 2),
    ("a.webm", "webm", "libopus", 48000, 2, None, 960, 1),
]


@pytest.mark.parametrize("name, fmt, codec, rate, channels, options, frame, slack", CONTAINERS,
                         ids=[c[0] for c in CONTAINERS])
def test_containers_decode_through_pyav(tmp_path, name, fmt, codec, rate, channels, options, frame, slack):
    path = tmp_path / name
    _encode(path, fmt, codec, rate, 3.0, freq=440.0, channels=channels, options=options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AudioWarning)
        a = load_audio(path)
    assert a.samples.dtype == np.float32 and a.samples.ndim == 1 and not a.truncated
    # duration within one codec frame (two for ADTS, which keeps the encoder's priming samples)
    assert abs(a.duration_s - 3.0) <= slack * frame / rate, a.duration_s
    # the sine's frequency survives: spectral peak away from the edges, to within one FFT bin (~0.4 Hz)
    y = a.samples[4000:44000]
    spectrum = np.abs(np.fft.rfft(y * np.hanning(y.shape[0])))
    assert abs(np.argmax(spectrum) * 16000 / y.shape[0] - 440.0) <= 0.5
    # and the waveform, at most a codec frame (or two) from where it was put
    ref = tone(3.0, 16000)
    lags = range(0, int(slack * frame * 16000 / rate) + 8)
    corr = [np.corrcoef(a.samples[d:d + 40000], ref[:40000])[0, 1] for d in lags]
    assert max(corr) > 0.99, max(corr)
    if fmt != "adts":
        assert a.expected_duration_s == pytest.approx(3.0, abs=frame / rate)


def test_container_sniffed_by_magic_not_name(tmp_path):
    path = tmp_path / "upload.bin"  # an m4a without its extension
    _encode(path, "ipod", "aac", 16000, 1.5)
    assert abs(load_audio(path).duration_s - 1.5) <= 1024 / 16000
    wav = tmp_path / "really_a_wav.m4a"  # and a WAV behind an m4a name is soundfile's
    x = noise(1.0, 28)
    sf.write(wav, x, 16000, subtype="FLOAT", format="WAV")
    np.testing.assert_array_equal(load_audio(wav).samples, x)


def test_corrupt_and_empty_containers(tmp_path):
    pytest.importorskip("av")
    rng = np.random.default_rng(0)
    (tmp_path / "empty.mp4").write_bytes(b"")
    with pytest.raises(AudioError, match=r"cannot decode audio file .*empty\.mp4: the file is empty \(0 bytes\)"):
        load_audio(tmp_path / "empty.mp4")
    (tmp_path / "noise.m4a").write_bytes(rng.bytes(4000))
    with pytest.raises(AudioError, match=r"cannot decode audio file .*noise\.m4a"):
        load_audio(tmp_path / "noise.m4a")
    (tmp_path / "bad.webm").write_bytes(b"\x1a\x45\xdf\xa3" + rng.bytes(500))
    with pytest.raises(AudioError, match=r"cannot decode audio file .*bad\.webm"):
        load_audio(tmp_path / "bad.webm")
    (tmp_path / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom" + rng.bytes(500))
    with pytest.raises(AudioError, match=r"cannot decode audio file .*bad\.mp4"):
        load_audio(tmp_path / "bad.mp4")
    full = tmp_path / "full.mp4"  # moov at the end (the default): a cut file has no index left
    _encode(full, "mp4", "aac", 44100, 3.0)
    with pytest.raises(AudioError, match=r"cannot decode audio file .*cut\.mp4: .*loses its index"):
        load_audio(_cut(full, tmp_path / "cut.mp4", 0.6))


@pytest.mark.parametrize("name, fmt, codec, rate, options", [
    ("fast.m4a", "ipod", "aac", 16000, {"movflags": "faststart"}),
    ("a.webm", "webm", "libopus", 48000, None),
])
def test_truncated_containers_warn(tmp_path, name, fmt, codec, rate, options):
    """With the index (or the duration) in front, a cut container decodes to what is there and says so."""
    full = tmp_path / name
    _encode(full, fmt, codec, rate, 3.0, options=options)
    cut = _cut(full, tmp_path / f"cut_{name}", 0.5)
    a, msgs = _load_warned(cut)
    assert a.truncated and 0.8 < a.duration_s < 2.2 and a.expected_duration_s == pytest.approx(3.0, abs=0.02)
    assert len(msgs) == 1 and str(cut) in msgs[0] and "s missing" in msgs[0], msgs


def test_truncated_adts_says_decoding_stopped(tmp_path):
    full = tmp_path / "a.aac"
    _encode(full, "adts", "aac", 44100, 3.0)
    a, msgs = _load_warned(_cut(full, tmp_path / "cut.aac", 0.5))
    assert a.truncated and a.expected_duration_s is None and 1.0 < a.duration_s < 2.0
    assert len(msgs) == 1 and "cut.aac: audio file is damaged or truncated: decoding stopped after" in msgs[0]


def test_containers_without_pyav_name_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "a.m4a"
    _encode(path, "ipod", "aac", 16000, 1.0)
    monkeypatch.setitem(sys.modules, "av", None)  # import av now raises ImportError
    with pytest.raises(AudioError, match=r"a\.m4a: M4A files are decoded with PyAV.*pip install 'glmasr\[containers\]'"):
        load_audio(path)
    with pytest.raises(AudioError, match="cannot decode.*broken.wav"):  # soundfile's failures stay soundfile's
        (tmp_path / "broken.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEgarbage" + bytes(100))
        load_audio(tmp_path / "broken.wav")


# ----------------------------------------------------------------- long files: block reads on threads


@pytest.fixture
def small_blocks(monkeypatch):
    """The threaded paths on short test files: 'long' from 1 s, reads of 4096 frames, 3 threads."""
    monkeypatch.setattr(rs_mod, "PARALLEL_MIN_S", 1.0)
    monkeypatch.setattr(rs_mod, "READ_BLOCK_FRAMES", 4096)
    monkeypatch.setattr(rs_mod, "AUDIO_THREADS", 3)
    calls = []
    original = audio_mod._sf_parallel

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(audio_mod, "_sf_parallel", spy)
    return calls


def _old_load(path):
    """What load_audio did before block reads: one sf.read, one float64 channel mean, one soxr call."""
    import soxr

    data, rate = sf.read(str(path), dtype="float32")
    if data.ndim == 2:
        data = data.mean(axis=1, dtype=np.float64).astype(np.float32)
    return data if rate == 16000 else soxr.resample(data, rate, 16000, quality="HQ").astype(np.float32)


@pytest.mark.parametrize("fmt, subtype, ext, rate, channels", [
    ("WAV", "PCM_16", "wav", 44100, 2), ("WAV", "FLOAT", "wav", 16000, 1), ("FLAC", "PCM_24", "flac", 48000, 3),
    ("MP3", "MPEG_LAYER_III", "mp3", 44100, 2),
])
def test_threaded_decode_is_bit_equal(tmp_path, small_blocks, monkeypatch, fmt, subtype, ext, rate, channels):
    """Blocks decoded on threads (own handle each, sample-exact seeks) and mixed block by block give exactly the
    samples of one sequential read, and exactly what the one-piece code gave."""
    x = np.stack([noise(12.0, 30 + c, rate=rate, scale=0.2) for c in range(channels)], axis=1)
    path = tmp_path / f"long.{ext}"
    sf.write(path, x if channels > 1 else x[:, 0], rate, format=fmt, subtype=subtype)
    threaded = load_audio(path)
    assert small_blocks == [True]  # the threaded read ran and was used
    monkeypatch.setattr(rs_mod, "AUDIO_THREADS", 1)
    sequential = load_audio(path)
    assert small_blocks == [True]
    np.testing.assert_array_equal(threaded.samples, sequential.samples)
    np.testing.assert_array_equal(sequential.samples, _old_load(path))
    assert not threaded.truncated


def test_threaded_decode_of_a_truncated_file_falls_back(tmp_path, small_blocks, monkeypatch):
    """A block that comes back short (the file ends before its header says) sends the decode down the
    sequential path, which finds the damage and warns once."""
    full = tmp_path / "full.flac"
    sf.write(full, noise(8.0, 40), 16000)
    cut = _cut(full, tmp_path / "cut.flac", 0.6)
    a, msgs = _load_warned(cut)
    assert small_blocks == [False] and a.truncated and len(msgs) == 1
    monkeypatch.setattr(rs_mod, "AUDIO_THREADS", 1)
    b, _ = _load_warned(cut)
    np.testing.assert_array_equal(a.samples, b.samples)


@pytest.mark.parametrize("rate, seconds", [(44100, 20.0), (8000, 13.3), (22050, 17.77), (48000, 9.0), (44056, 11.0)])
def test_threaded_resample_within_float32_rounding(monkeypatch, rate, seconds):
    """Block resampling (``resample(..., threads=N)``, the default on hosts with >= 4 CPUs): same length as one soxr call and within 1e-6
    absolute of it (measured ~1e-7: float32 rounding inside soxr), on noise plus a tone, block edges included."""
    monkeypatch.setattr(rs_mod, "PARALLEL_MIN_S", 1.0)
    n = int(seconds * rate) + 7  # not a whole number of the rates' common period
    x = noise(n / rate, 41, rate=rate, scale=0.2)[:n] + tone(n / rate + 1, rate, 997.0)[:n]
    one = resample(x, rate, threads=1)
    calls = []
    import soxr

    original = soxr.resample
    monkeypatch.setattr(soxr, "resample", lambda *a, **k: calls.append(1) or original(*a, **k))
    blocks = resample(x, rate, threads=3)
    assert len(calls) > 3  # it did run in blocks
    assert blocks.shape == one.shape and blocks.dtype == np.float32
    err = float(np.abs(blocks - one).max())
    print(f"\nthreaded resample {rate} Hz -> 16 kHz, {len(calls)} blocks: max |blocks - one-shot| = {err:.2e}")
    assert err < 1e-6
    assert np.array_equal(resample(x, rate, threads=1), one)  # one soxr call is deterministic


@pytest.mark.parametrize("channels", [2, 3, 5, 7, 8, 12])
def test_channel_mix_is_numpys_float64_mean_bit_for_bit(monkeypatch, channels):
    """The block-wise mono mix (channel after channel into one float64 accumulator below 8 channels) gives the
    bits of ``mean(axis, dtype=float64)``, for arrays in both orientations and across block edges, on values
    spanning many magnitudes."""
    monkeypatch.setattr(rs_mod, "READ_BLOCK_FRAMES", 1000)
    rng = np.random.default_rng(channels)
    x = (rng.standard_normal((5001, channels)) * np.logspace(-7, 0, channels)).astype(np.float32)
    x[::5, 0] *= np.float32(1e-30)
    expected = x.mean(axis=1, dtype=np.float64).astype(np.float32)
    np.testing.assert_array_equal(load_audio(x, 16000).samples, expected)
    np.testing.assert_array_equal(load_audio(np.ascontiguousarray(x.T), 16000).samples, expected)


@pytest.mark.parametrize("subtype", ["IMA_ADPCM", "MS_ADPCM", "ULAW"])
def test_truncated_wav_with_other_codecs(tmp_path, subtype):
    """Compressed WAV codecs: the length comes from the fact chunk (or, without one, the data chunk still runs past
    the end of the file)."""
    full = tmp_path / "full.wav"
    sf.write(full, noise(4.0, 29), 16000, subtype=subtype)
    assert load_audio(full).truncated is False
    a, msgs = _load_warned(_cut(full, tmp_path / "cut.wav", 0.5))
    assert a.truncated and len(msgs) == 1 and "cut.wav" in msgs[0], msgs
    assert 1.5 < a.duration_s < 2.2


# ------------------------------------------------------------------- bytes in memory (uploads): one decoder

from glmasr.audio import (AudioDecodeError, AudioTooLongError, EmptyAudioFileError, InvalidAudioError,  # noqa: E402
                          TruncatedAudioError, UnsupportedFormatError, decode_audio_bytes)

SOUNDFILE_FORMATS = [  # name, format, subtype, rate, channels
    ("a.wav", "WAV", "PCM_16", 44100, 2), ("f.wav", "WAV", "FLOAT", 16000, 1),
    ("a.flac", "FLAC", "PCM_24", 48000, 1), ("a.mp3", "MP3", "MPEG_LAYER_III", 44100, 2),
    ("a.ogg", "OGG", "VORBIS", 22050, 1), ("a.opus", "OGG", "OPUS", 48000, 1),
]


def _sf_file(path, seconds, fmt, subtype, rate, channels=1, seed=50):
    x = np.stack([noise(seconds, seed + c, rate=rate, scale=0.2) for c in range(channels)], axis=1)
    sf.write(path, x if channels > 1 else x[:, 0], rate, format=fmt, subtype=subtype)
    return path


def _assert_same_audio(a, b):
    assert a.samples.dtype == b.samples.dtype == np.float32
    np.testing.assert_array_equal(a.samples, b.samples)
    assert (a.truncated, a.expected_duration_s) == (b.truncated, b.expected_duration_s)


@pytest.mark.parametrize("name, fmt, subtype, rate, channels", SOUNDFILE_FORMATS,
                         ids=[f[0] for f in SOUNDFILE_FORMATS])
def test_bytes_equal_the_file_sample_for_sample(tmp_path, name, fmt, subtype, rate, channels):
    """The bytes of a file decode to exactly what load_audio gives for the file, whatever the name says."""
    path = _sf_file(tmp_path / name, 3.0, fmt, subtype, rate, channels)
    data = path.read_bytes()
    assert audio_mod._sniff_container(data[:64]) is None  # libsndfile's, from the magic bytes
    from_file = load_audio(path)
    for label in ("upload", "clip.m4a", "clip.webm"):  # the name never picks the decoder
        a = decode_audio_bytes(data, label)
        _assert_same_audio(a, from_file)
        assert a.source == label and not a.truncated


@pytest.mark.parametrize("name, fmt, codec, rate, channels, options, frame, slack", CONTAINERS,
                         ids=[c[0] for c in CONTAINERS])
def test_container_bytes_equal_the_file(tmp_path, name, fmt, codec, rate, channels, options, frame, slack):
    """mp4/m4a/adts/webm made with PyAV: detected from the bytes (under any name) and decoded to the file's samples."""
    path = tmp_path / name
    _encode(path, fmt, codec, rate, 2.0, channels=channels, options=options)
    data = path.read_bytes()
    kind = {"mp4": "MP4", "ipod": "M4A", "adts": "AAC (ADTS)", "webm": "WebM"}[fmt]
    assert audio_mod._sniff_container(data[:64]) == kind
    from_file = load_audio(path)
    _assert_same_audio(decode_audio_bytes(data, "upload.wav"), from_file)
    _assert_same_audio(decode_audio_bytes(bytearray(data)), from_file)  # any bytes-like


def test_bytes_take_the_threaded_path_too(tmp_path, small_blocks, monkeypatch):
    path = _sf_file(tmp_path / "long.flac", 12.0, "FLAC", "PCM_16", 16000, 2)
    threaded = decode_audio_bytes(path.read_bytes())
    assert small_blocks == [True]
    monkeypatch.setattr(rs_mod, "AUDIO_THREADS", 1)
    _assert_same_audio(threaded, load_audio(path))
    # a limit the audio is under keeps the threaded path and its samples
    monkeypatch.setattr(rs_mod, "AUDIO_THREADS", 3)
    _assert_same_audio(decode_audio_bytes(path.read_bytes(), max_duration_s=12.0), threaded)
    assert small_blocks == [True, True]


def test_bytes_errors_are_typed_with_codes(tmp_path):
    full = _sf_file(tmp_path / "a.wav", 2.0, "WAV", "PCM_16", 16000).read_bytes()
    cases = [
        (b"", EmptyAudioFileError, "empty_file", r"^cannot decode up\.wav: the file is empty \(0 bytes\)$"),
        (b"this is not audio at all" * 10, InvalidAudioError, "invalid_audio",
         r"^cannot decode up\.wav: .*\(readable: wav, flac"),
        (b"RIFF\x00\x00\x00\x00WAVEgarbage" + bytes(100), InvalidAudioError, "invalid_audio",
         r"^cannot decode up\.wav: (?!.*readable)"),  # a known magic: damaged, no list of formats
        (full[:44], InvalidAudioError, "invalid_audio", r"^up\.wav: audio is empty: nothing could be decoded.*2\.00 s"),
    ]
    for data, cls, code, match in cases:
        with pytest.raises(cls, match=match) as e:
            decode_audio_bytes(data, "up.wav")
        assert type(e.value) is cls and e.value.code == code
        assert isinstance(e.value, AudioDecodeError) and isinstance(e.value, AudioError)  # old handlers still catch
    x = np.full(16000, np.nan, np.float32)
    b = io.BytesIO()
    sf.write(b, x, 16000, format="WAV", subtype="FLOAT")
    with pytest.raises(InvalidAudioError, match=r"^up\.wav: audio has 16000 NaN"):
        decode_audio_bytes(b.getvalue(), "up.wav")
    with pytest.raises(TypeError, match="takes bytes"):
        decode_audio_bytes(str(tmp_path / "a.wav"))
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max_duration_s"):
            decode_audio_bytes(full, max_duration_s=bad)


def test_files_raise_the_same_typed_errors(tmp_path):
    (tmp_path / "empty.wav").write_bytes(b"")
    with pytest.raises(EmptyAudioFileError):
        load_audio(tmp_path / "empty.wav")
    with pytest.raises(EmptyAudioFileError, match=r"^clip 5: cannot decode audio file .*empty\.wav") as e:
        load_audio(tmp_path / "empty.wav", source="clip 5")  # the source prefix keeps the class and code
    assert e.value.code == "empty_file"


def test_corrupt_container_bytes_are_invalid_audio(tmp_path):
    pytest.importorskip("av")
    rng = np.random.default_rng(1)
    for data in (b"\x00\x00\x00\x18ftypisom" + rng.bytes(500), b"\x1a\x45\xdf\xa3" + rng.bytes(500)):
        with pytest.raises(InvalidAudioError, match=r"^cannot decode x: ") as e:
            decode_audio_bytes(data, "x")
        assert e.value.code == "invalid_audio" and e.value.format in ("MP4", "Matroska")
    full = tmp_path / "full.mp4"  # moov at the end: a cut upload has no index
    _encode(full, "mp4", "aac", 44100, 2.0)
    with pytest.raises(InvalidAudioError, match="loses its index"):
        decode_audio_bytes(full.read_bytes()[: int(full.stat().st_size * 0.6)], "x")


def test_container_bytes_without_pyav_are_unsupported_format(tmp_path, monkeypatch):
    path = tmp_path / "a.m4a"
    _encode(path, "ipod", "aac", 16000, 1.0)
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(UnsupportedFormatError, match=r"^cannot decode up: M4A files are decoded with PyAV.*"
                                                     r"glmasr\[containers\]") as e:
        decode_audio_bytes(path.read_bytes(), "up")
    assert e.value.code == "unsupported_format" and e.value.format == "M4A"


def test_truncated_bytes_warn_like_files_or_are_refused(tmp_path):
    full = _sf_file(tmp_path / "full.flac", 5.94, "FLAC", "PCM_16", 16000)
    cut = _cut(full, tmp_path / "cut.flac", 0.5)
    from_file, file_msgs = _load_warned(cut)
    a, msgs = _warned(decode_audio_bytes, cut.read_bytes(), "cut upload")
    _assert_same_audio(a, from_file)
    assert a.truncated and len(msgs) == len(file_msgs) == 1
    assert msgs[0] == file_msgs[0].replace(str(cut), "cut upload")
    with pytest.raises(TruncatedAudioError, match=r"^cut upload: truncated audio file: its header declares 5\.94") as e:
        decode_audio_bytes(cut.read_bytes(), "cut upload", allow_truncated=False)
    assert e.value.code == "invalid_audio" and e.value.format == "FLAC/PCM_16"
    wav = _sf_file(tmp_path / "full.wav", 2.0, "WAV", "PCM_16", 16000).read_bytes()
    with pytest.raises(TruncatedAudioError):  # a cut WAV has the same tell: its data chunk runs past the end
        decode_audio_bytes(wav[: len(wav) // 2], allow_truncated=False)


@pytest.mark.parametrize("name, fmt, subtype, rate", [("a.wav", "WAV", "PCM_16", 8000),
                                                      ("a.flac", "FLAC", "PCM_16", 16000),
                                                      ("a.ogg", "OGG", "VORBIS", 16000)])
def test_too_long_from_the_header_before_decoding(tmp_path, monkeypatch, name, fmt, subtype, rate):
    data = _sf_file(tmp_path / name, 10.0, fmt, subtype, rate).read_bytes()
    reads = []
    monkeypatch.setattr(sf.SoundFile, "read", lambda self, *a, **k: reads.append(1))
    with pytest.raises(AudioTooLongError, match=rf"^up: the {fmt}/{subtype} audio is 10\.0 s long .*limit of 8 s") \
            as e:
        decode_audio_bytes(data, "up", max_duration_s=8)
    assert not reads  # nothing was decoded
    err = e.value
    assert err.code == "audio_too_long" and err.limit_s == 8 and err.decoded_s is None
    assert err.duration_s == pytest.approx(10.0, abs=0.06)


def test_too_long_container_from_its_header(tmp_path):
    path = tmp_path / "a.m4a"
    _encode(path, "ipod", "aac", 16000, 6.0)
    with pytest.raises(AudioTooLongError, match=r"^up: the M4A \(aac\) audio is 6\.0 s long") as e:
        decode_audio_bytes(path.read_bytes(), "up", max_duration_s=4)
    assert e.value.decoded_s is None and e.value.format == "M4A (aac)"
    assert decode_audio_bytes(path.read_bytes(), max_duration_s=6.5).duration_s == pytest.approx(6.0, abs=0.07)


def test_mp3_limit_is_enforced_while_decoding(tmp_path, monkeypatch):
    """MP3's frame count is not trusted (an estimate without a Xing header), so the limit is counted while decoding:
    the reads stop one frame past it, however long the file is."""
    rate = 44100
    data = _sf_file(tmp_path / "long.mp3", 60.0, "MP3", "MPEG_LAYER_III", rate).read_bytes()
    read_frames = []
    original = sf.SoundFile.read

    def counting(self, frames=-1, *a, **k):
        out = original(self, frames, *a, **k)
        read_frames.append(len(out))
        return out

    monkeypatch.setattr(sf.SoundFile, "read", counting)
    with pytest.raises(AudioTooLongError, match=r"longer than the limit of 5 s \(decoding stopped after 5\.00 s") \
            as e:
        decode_audio_bytes(data, "long.mp3", max_duration_s=5)
    assert sum(read_frames) == 5 * rate + 1  # exactly one frame past the limit was read, not the 60 s
    assert e.value.duration_s is None and e.value.decoded_s == pytest.approx(5.0, abs=1e-4)
    # just under the limit it decodes, equal to the unlimited decode
    short = _sf_file(tmp_path / "short.mp3", 3.0, "MP3", "MPEG_LAYER_III", rate).read_bytes()
    _assert_same_audio(decode_audio_bytes(short, max_duration_s=3.2), decode_audio_bytes(short))


def test_adts_limit_is_enforced_while_decoding(tmp_path):
    """ADTS declares no duration: PyAV's frames are counted and decoding stops at the first past the limit."""
    path = tmp_path / "long.aac"
    _encode(path, "adts", "aac", 16000, 30.0)
    with pytest.raises(AudioTooLongError) as e:
        decode_audio_bytes(path.read_bytes(), "long.aac", max_duration_s=2)
    assert e.value.duration_s is None and 2.0 < e.value.decoded_s <= 2.0 + 1024 / 16000
    assert e.value.format == "AAC (ADTS) (aac)"


def test_a_limit_at_the_exact_duration_passes(tmp_path):
    data = _sf_file(tmp_path / "a.wav", 5.0, "WAV", "PCM_16", 16000).read_bytes()
    assert decode_audio_bytes(data, max_duration_s=5.0).duration_s == 5.0
    with pytest.raises(AudioTooLongError):
        decode_audio_bytes(data, max_duration_s=4.9999)


def test_audio_module_does_not_import_the_server():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(audio_mod))
    names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [n for n in names if "server" in n], names


def test_default_resampling_threads_follow_the_host(monkeypatch):
    """Long audio is resampled on threads by default where at least RESAMPLE_MIN_CPUS are usable, else in one
    soxr call; the output is the same within float32 rounding either way."""
    from glmasr.audio import resampler as A

    monkeypatch.setattr(A, "AUDIO_THREADS", 2)
    assert A._resample_threads() == 1
    monkeypatch.setattr(A, "AUDIO_THREADS", 6)
    assert A._resample_threads() == 6
    x = np.random.default_rng(3).standard_normal(int(70 * 22050)).astype(np.float32) * 0.1
    threaded = A.resample(x, 22050)
    one = A.resample(x, 22050, threads=1)
    assert threaded.shape == one.shape and np.max(np.abs(threaded - one)) <= 1e-6


# ------------------------------------------------------------------------------------ native reads
# libsndfile reads a Python file object through callbacks that each take the GIL (slow under a busy event loop);
# in-memory audio is handed to it as a memfd path and a spooled upload on disk as its fd's path
# (``_Source.native_path``). The samples must be the callback path's, bit for bit, whatever the format or damage.

native = pytest.mark.skipif(not (hasattr(__import__("os"), "memfd_create")
                                 and __import__("os").path.isdir("/proc/self/fd")), reason="Linux memfd only")


def _encoded(fmt, subtype, seconds=3.0, rate=16000, channels=1, seed=0):
    x = (np.random.default_rng(seed).standard_normal((int(seconds * rate), channels)) * 0.1).astype(np.float32)
    b = io.BytesIO()
    sf.write(b, x, rate, format=fmt, subtype=subtype)
    return b.getvalue()


def _sources(data, tmp_path):
    """The same bytes as bytes, a spooled upload in memory and on disk, a caller's BytesIO and an open file."""
    import tempfile

    small = tempfile.SpooledTemporaryFile(max_size=len(data) + 1)
    small.write(data)
    rolled = tempfile.SpooledTemporaryFile(max_size=16)
    rolled.write(data)
    path = tmp_path / "audio.bin"
    path.write_bytes(data)
    return {"bytes": data, "spooled in memory": small, "spooled on disk": rolled, "BytesIO": io.BytesIO(data),
            "open file": open(path, "rb")}


def _decode_any(src, label="upload"):
    from glmasr.audio import decode_audio_bytes, decode_audio_file

    if isinstance(src, bytes):
        return decode_audio_bytes(src, label)
    return decode_audio_file(src, label)


@native
@pytest.mark.parametrize("fmt,subtype,rate,channels", [("WAV", "PCM_16", 16000, 1), ("WAV", "FLOAT", 44100, 2),
                                                        ("FLAC", "PCM_24", 22050, 1), ("OGG", "VORBIS", 16000, 1)])
def test_native_reads_equal_the_callback_path(tmp_path, monkeypatch, fmt, subtype, rate, channels):
    import os

    data = _encoded(fmt, subtype, 3.0, rate, channels)
    fds = len(os.listdir("/proc/self/fd"))
    for name, src in _sources(data, tmp_path).items():
        made = []
        real_native = audio_mod._Source.native_path
        monkeypatch.setattr(audio_mod._Source, "native_path", lambda self: made.append(real_native(self)) or made[-1])
        calls = []
        monkeypatch.setattr(audio_mod._Source, "target", lambda self: calls.append(1) or self.open())
        got = _decode_any(src)
        monkeypatch.undo()
        assert made and all(p is not None and p.startswith("/proc/self/fd/") for p in made), (name, made)
        assert calls == [], f"{name}: libsndfile was given a Python file object"
        monkeypatch.setattr(audio_mod._Source, "native_path", lambda self: None)  # the callback path
        want = _decode_any(src)
        monkeypatch.undo()
        assert np.array_equal(got.samples, want.samples) and got.samples.size > 0, name
        if hasattr(src, "close"):
            src.close()
    assert len(os.listdir("/proc/self/fd")) == fds, "a memfd or file descriptor leaked"


@native
def test_native_reads_keep_truncation_and_limits(tmp_path, monkeypatch):
    from glmasr.audio import decode_audio_bytes
    from glmasr.errors import AudioTooLongError

    data = _encoded("WAV", "PCM_16", 6.0)
    cut = data[: len(data) * 2 // 3]
    with pytest.warns(AudioWarning, match="truncated"):
        a = decode_audio_bytes(cut, "upload")
    monkeypatch.setattr(audio_mod._Source, "native_path", lambda self: None)
    with pytest.warns(AudioWarning, match="truncated"):
        b = decode_audio_bytes(cut, "upload")
    monkeypatch.undo()
    assert a.truncated and b.truncated and np.array_equal(a.samples, b.samples)
    with pytest.raises(AudioTooLongError):
        decode_audio_bytes(data, "upload", max_duration_s=2.0)


@native
def test_native_copy_is_bounded(monkeypatch):
    """In-memory audio above NATIVE_COPY_MAX_BYTES is not copied: it decodes through the callbacks."""
    data = _encoded("WAV", "PCM_16", 1.0)
    monkeypatch.setattr(audio_mod, "NATIVE_COPY_MAX_BYTES", len(data) - 1)
    src = audio_mod._Source("upload", data=data)
    assert src.native_path() is None
    monkeypatch.undo()
    src = audio_mod._Source("upload", data=data)
    assert src.native_path().startswith("/proc/self/fd/")
    src.close()
    assert src._memfd is None
