"""Decoding limits: what a file or upload can make the decoder allocate (sample rate, channels, samples: held to
the bound that glmasr/audio/decode.py's docstring states), files that declare no length, malformed headers, and decoding
a file object in place."""

import io
import shutil
import struct
import subprocess
import sys
import tempfile
import tracemalloc
import warnings

import numpy as np
import pytest
import soundfile as sf
import soxr

from glmasr.audio import decode as audio_mod
from glmasr.audio import resampler as rs_mod
from glmasr.audio import (Audio, AudioDecodeError, AudioTooLongError, AudioWarning, InvalidAudioError,
                          TruncatedAudioError, UnsupportedAudioError, decode_audio_bytes, decode_audio_file,
                          load_audio)

from conftest import noise, pyav_encode

MIB = 1 << 20
OUT_BYTES_PER_S = 16000 * 4  # the decoded 16 kHz mono float32
BOUND_K, BOUND_C = 3, 4 * MIB  # the module docstring's bound: input + 3 x the decoded output + 4 MiB


def bound(seconds: float) -> float:
    """Peak bytes a decode of ``seconds`` of output may allocate besides the input the caller holds."""
    return BOUND_K * OUT_BYTES_PER_S * seconds + BOUND_C


def traced(fn, *args, **kwargs):
    """(fn's result, or the AudioDecodeError it raised; the peak bytes traced while it ran). numpy reports every
    array buffer it allocates to tracemalloc, so the read blocks, the mixes, the resampled pieces and the output
    are all counted (the C libraries' own small buffers are not). Any other exception propagates."""
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AudioWarning)
            try:
                result = fn(*args, **kwargs)
            except AudioDecodeError as e:
                result = e
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def signal(seconds, rate, channels, seed, scale=0.1):
    """Fresh noise, (frames, channels)."""
    return np.stack([noise(seconds, seed + c, rate=rate, scale=scale) for c in range(channels)], axis=1)


def encoded(x, rate, fmt, subtype):
    b = io.BytesIO()
    sf.write(b, x, rate, format=fmt, subtype=subtype)
    return b.getvalue()


def reference(data):
    """What a 16 kHz mono decode must give, from the whole file at once: libsndfile's samples, the float64 channel
    mean, one soxr call."""
    x, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    mono = x[:, 0] if x.shape[1] == 1 else x.mean(axis=1, dtype=np.float64).astype(np.float32)
    return mono if rate == 16000 else soxr.resample(mono, rate, 16000, quality="HQ")


def wav_bytes(channels, rate, bits=16, tag=1, data=b""):
    """A WAV header written by hand (fields a writer library would refuse), then ``data``."""
    align = (channels * max(bits, 8) // 8) & 0xFFFF
    fmt = struct.pack("<HHIIHH", tag, channels, rate, (rate * align) & 0xFFFFFFFF, align, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def streaminfo_total(data: bytes) -> int:
    """The total-samples field of a FLAC's STREAMINFO (36 bits; 0 = unknown)."""
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO is the first metadata block
    return int.from_bytes(data[18:26], "big") & ((1 << 36) - 1)


def with_unknown_length(data: bytes) -> bytes:
    """The FLAC with its STREAMINFO's total samples set to 0, as a writer that cannot seek back leaves it."""
    b = bytearray(data)
    b[18:26] = (int.from_bytes(b[18:26], "big") & ~((1 << 36) - 1)).to_bytes(8, "big")
    return bytes(b)


def container(fmt, codec, rate, x, layout):
    """x (frames, channels) encoded with PyAV: e.g. AAC in m4a, float PCM in Matroska."""
    pytest.importorskip("av")
    return pyav_encode(x, rate, fmt, codec, layout)


def _same(a, b):
    np.testing.assert_array_equal(a.samples, b.samples)
    assert (a.truncated, a.expected_duration_s) == (b.truncated, b.expected_duration_s)


# ------------------------------------------------------------------------------ sample rate and channels


def test_sample_rate_above_the_ceiling_is_refused_before_decoding(tmp_path, monkeypatch):
    """A FLAC at 655,350 Hz (FLAC's own maximum) was decoded whole at that rate before its rate was looked at
    (a 256 KiB upload cost 546 MB). It is refused from its header: nothing decoded, almost nothing allocated."""
    data = encoded(signal(2.0, 655350, 1, 1, scale=1e-3), 655350, "FLAC", "PCM_16")
    path = tmp_path / "x.flac"
    path.write_bytes(data)
    reads = []
    monkeypatch.setattr(sf.SoundFile, "read", lambda self, *a, **k: reads.append(1))
    for call, label in ((lambda: decode_audio_bytes(data, "x.flac", 3600), "x.flac"),
                        (lambda: decode_audio_file(path, "x.flac", 3600), "x.flac"),
                        (lambda: load_audio(path), f"audio file {path}")):
        err, peak = traced(call)
        assert isinstance(err, UnsupportedAudioError), err
        assert str(err) == f"{label}: sample rate 655350 Hz is above the limit of 384000 Hz"
        assert err.code == "unsupported_audio" and (err.field, err.value, err.limit) == ("sample_rate", 655350, 384000)
        assert err.format == "FLAC/PCM_16"
        assert peak < MIB // 4, peak
    assert not reads


def test_sample_rate_limits_in_a_container():
    """The same ceiling through PyAV (Matroska, float PCM at 768 kHz), from the stream's header."""
    data = container("matroska", "pcm_f32le", 768000, signal(0.1, 768000, 1, 2), "mono")
    err, peak = traced(decode_audio_bytes, data, "x.mkv")
    assert isinstance(err, UnsupportedAudioError) and err.field == "sample_rate" and err.value == 768000, err
    assert str(err) == "x.mkv: sample rate 768000 Hz is above the limit of 384000 Hz"
    assert peak < MIB


def test_sample_rate_below_the_floor_is_refused_before_decoding():
    data = encoded(signal(1.0, 800, 1, 3), 800, "WAV", "PCM_16")
    with pytest.raises(UnsupportedAudioError, match=r"^low\.wav: sample rate 800 Hz is below the minimum of 1000 Hz$") \
            as e:
        decode_audio_bytes(data, "low.wav")
    assert (e.value.field, e.value.value, e.value.limit) == ("sample_rate", 800, 1000)
    x = signal(1.0, 1000, 1, 3)  # the floor itself decodes
    np.testing.assert_array_equal(decode_audio_bytes(encoded(x, 1000, "WAV", "FLOAT")).samples,
                                  soxr.resample(x[:, 0], 1000, 16000, quality="HQ"))


def test_384_khz_multichannel_within_the_bound():
    """2 s of 8-channel FLAC at 384 kHz (the ceiling): read in blocks of bytes, mixed and resampled as it comes.
    The whole signal at 384 kHz would be 24.6 MB (the old decoder's peak was 17 MiB of numpy buffers); the bound
    for 2 s of output is 4.4 MiB. The samples are bit for bit the one-shot mix and soxr call."""
    data = encoded(signal(2.0, 384000, 8, 4, scale=1e-3), 384000, "FLAC", "PCM_16")
    a, peak = traced(decode_audio_bytes, data, "hi.flac")
    assert isinstance(a, Audio), a
    assert a.duration_s == pytest.approx(2.0) and not a.truncated
    assert peak <= bound(a.duration_s), (peak, bound(a.duration_s))
    np.testing.assert_array_equal(a.samples, reference(data))


@pytest.mark.parametrize("channels", [65, 1000, 65535])
def test_wav_claiming_too_many_channels_is_refused(monkeypatch, channels):
    """A WAV header can claim 65535 channels (libsndfile refuses more than 1024 itself, but opens 1000, and reads
    were sized in frames x channels). The header is read first and the file refused, naming the field; the same
    without PyAV."""
    data = wav_bytes(channels, 16000, data=np.random.default_rng(channels).bytes(4 * 65536))
    msg = rf"^c\.wav: {channels} channels are more than the limit of 64$"
    with pytest.raises(UnsupportedAudioError, match=msg) as e:
        decode_audio_bytes(data, "c.wav")
    assert (e.value.field, e.value.value, e.value.limit, e.value.code) == ("channels", channels, 64,
                                                                           "unsupported_audio")
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(UnsupportedAudioError, match=msg):
        decode_audio_bytes(data, "c.wav")


def test_64_channels_decode():
    x = signal(0.25, 16000, 64, 5)
    data = encoded(x, 16000, "WAV", "FLOAT")
    np.testing.assert_array_equal(decode_audio_bytes(data).samples, x.mean(axis=1, dtype=np.float64).astype(np.float32))


def test_eight_channel_container_decodes():
    """7.1 audio through PyAV: planar float arrays of 8 or more channels read past the frame's plane pointers in
    PyAV and killed the process (SIGSEGV). Packed float is read instead: exact samples, mixed and resampled."""
    x = signal(0.3, 48000, 8, 6)
    a = decode_audio_bytes(container("matroska", "pcm_f32le", 48000, x, "7.1"), "x.mkv")
    mono = x.mean(axis=1, dtype=np.float64).astype(np.float32)
    np.testing.assert_array_equal(a.samples, soxr.resample(mono, 48000, 16000, quality="HQ"))


def test_alac_with_giant_codec_frames_is_refused():
    """ALAC's header sets the samples per codec frame, up to 4096 x 4096 (FFmpeg then decodes 64 MiB a channel at
    once); encoders write 4096. More than MAX_CODEC_FRAME_SAMPLES is refused from the header."""
    data = container("ipod", "alac", 16000, signal(0.5, 16000, 1, 11), "mono")
    assert decode_audio_bytes(data).duration_s == pytest.approx(0.5, abs=0.01)
    at = data.rindex(b"alac") + 8  # the magic cookie's frameLength, after the atom's version and flags
    assert struct.unpack(">I", data[at:at + 4])[0] == 4096
    patched = data[:at] + struct.pack(">I", 4096 * 4096) + data[at + 4:]
    with pytest.raises(UnsupportedAudioError, match=r"^a\.m4a: codec frames of 16777216 samples are more than the "
                                                    r"limit of 131072$") as e:
        decode_audio_bytes(patched, "a.m4a")
    assert (e.value.field, e.value.value, e.value.limit) == ("frame_samples", 4096 * 4096, 131072)


# --------------------------------------------------------------------------- samples: limits and length


def test_limit_is_counted_in_frames_and_bounds_memory():
    """Over the limit, decoding stops one frame past it; what was allocated is bounded by the limit's output."""
    data = encoded(signal(20.0, 44100, 2, 7), 44100, "MP3", "MPEG_LAYER_III")  # MP3: limited while decoding
    err, peak = traced(decode_audio_bytes, data, "long.mp3", 3.0)
    assert isinstance(err, AudioTooLongError) and err.decoded_s == pytest.approx(3.0, abs=1e-4), err
    assert peak <= bound(3.0), peak


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs the ffmpeg program")
def test_flac_written_to_a_pipe_gives_every_sample(tmp_path):
    """``ffmpeg -f flac pipe:1`` cannot seek back to write the length: STREAMINFO says 0 ("unknown"), libsndfile
    then reports 2^63 - 1 frames and the file was refused as "576460752303423.5 s long" (or decoded short and
    called truncated). Unknown length: decoded to the end, counted against the limit, every sample returned."""
    wav = tmp_path / "x.wav"
    sf.write(wav, signal(3.3, 44100, 2, 8, scale=0.2), 44100, subtype="PCM_16")
    piped, normal = tmp_path / "piped.flac", tmp_path / "normal.flac"
    with open(piped, "wb") as out:
        subprocess.run(["ffmpeg", "-nostdin", "-loglevel", "error", "-i", str(wav), "-f", "flac", "pipe:1"],
                       stdout=out, check=True)
    subprocess.run(["ffmpeg", "-nostdin", "-loglevel", "error", "-i", str(wav), str(normal)], check=True)
    assert streaminfo_total(piped.read_bytes()) == 0 and streaminfo_total(normal.read_bytes()) == 145530
    ref = decode_audio_bytes(normal.read_bytes(), "normal.flac")
    np.testing.assert_array_equal(ref.samples, reference(wav.read_bytes()))
    data = piped.read_bytes()
    for a in (decode_audio_bytes(data, "piped.flac", 3600, allow_truncated=False), load_audio(piped),
              decode_audio_file(piped, "piped.flac", 3600, allow_truncated=False)):
        np.testing.assert_array_equal(a.samples, ref.samples)
        assert not a.truncated and a.expected_duration_s is None
    with pytest.raises(AudioTooLongError, match=r"^piped\.flac: the FLAC/PCM_16 audio is longer than the limit of "
                                                r"2 s \(decoding stopped after 2\.00 s\)$") as e:
        decode_audio_bytes(data, "piped.flac", 2.0)
    assert e.value.duration_s is None


@pytest.mark.parametrize("frames", [5 * 4096, 5 * 4096 + 1, 3 * 4096 - 77])
@pytest.mark.parametrize("rate, channels", [(16000, 1), (44100, 2), (48000, 3)])
def test_flac_with_no_length_in_streaminfo(monkeypatch, frames, rate, channels):
    """The same with a STREAMINFO patched to 0 total samples, in blocks of 4096 frames so the stream ends on a
    block's edge, just past one, and inside one; and with the threaded settings (no length: sequential)."""
    x = np.stack([noise(frames / rate, 60 + c, rate=rate, scale=0.2)[:frames] for c in range(channels)], axis=1)
    data = encoded(x, rate, "FLAC", "PCM_24")
    patched = with_unknown_length(data)
    assert streaminfo_total(data) == frames and streaminfo_total(patched) == 0
    monkeypatch.setattr(audio_mod, "READ_BLOCK_BYTES", 4096 * 4 * channels)
    ref = decode_audio_bytes(data)
    assert not ref.truncated and ref.expected_duration_s == pytest.approx(frames / rate)
    a = decode_audio_bytes(patched, allow_truncated=False)
    np.testing.assert_array_equal(a.samples, ref.samples)
    assert not a.truncated and a.expected_duration_s is None
    monkeypatch.setattr(rs_mod, "PARALLEL_MIN_S", 0.1)
    monkeypatch.setattr(rs_mod, "AUDIO_THREADS", 3)
    np.testing.assert_array_equal(decode_audio_bytes(patched, max_duration_s=60).samples, ref.samples)
    with pytest.raises(AudioTooLongError) as e:  # counted while decoding: no header to refuse it from
        decode_audio_bytes(patched, max_duration_s=frames / rate / 2)
    assert e.value.duration_s is None and e.value.decoded_s == pytest.approx(frames / rate / 2, abs=1 / rate)


def test_a_cut_flac_of_unknown_length_is_still_truncated():
    """No length to compare with, but the decoder's own error part-way still says the file is damaged."""
    data = with_unknown_length(encoded(signal(3.0, 16000, 1, 9, scale=0.2), 16000, "FLAC", "PCM_16"))
    cut = data[: len(data) // 2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = decode_audio_bytes(cut, "cut.flac")
    assert a.truncated and 1.0 < a.duration_s < 1.6
    assert [str(w.message) for w in caught if w.category is AudioWarning][0].startswith(
        "cut.flac: audio file is damaged or truncated: decoding stopped after")
    with pytest.raises(TruncatedAudioError):
        decode_audio_bytes(cut, "cut.flac", allow_truncated=False)


# ------------------------------------------------------------------------------------ malformed headers


@pytest.mark.parametrize("pyav", [True, False], ids=["pyav", "no-pyav"])
@pytest.mark.parametrize("tag, bits, detail", [(0x1234, 16, "WAV format tag 0x1234, 16 bits per sample"),
                                               (1, 0, "WAV format tag 0x0001, 0 bits per sample")],
                         ids=["unknown-tag", "bits-0"])
def test_wav_with_an_unknown_format_tag_or_no_bits(monkeypatch, pyav, tag, bits, detail):
    """libsndfile refuses these; PyAV's fallback then found no codec (``codec_context`` None) and the
    AttributeError became a 500. Now an InvalidAudioError naming what the header says."""
    if pyav:
        pytest.importorskip("av")
    else:
        monkeypatch.setitem(sys.modules, "av", None)
    data = wav_bytes(1, 16000, bits=bits, tag=tag, data=np.random.default_rng(tag + bits).bytes(32000))
    with pytest.raises(InvalidAudioError, match=r"^cannot decode odd\.wav: ") as e:
        decode_audio_bytes(data, "odd.wav")
    assert f"({detail}, 1 channel, 16000 Hz)" in str(e.value) and e.value.code == "invalid_audio"


@pytest.mark.parametrize("via", ["path", "bytes", "file"])
def test_random_bytes_are_not_a_recognised_format(tmp_path, via):
    """libsndfile's words for bytes it cannot place ("File does not exist or is not a regular file (possibly a
    pipe?)" for a path) misled; the message says what happened and what is readable."""
    data = np.random.default_rng(16).bytes(20000)
    path = tmp_path / "x.mp3"
    path.write_bytes(data)
    call = {"path": lambda: load_audio(path), "bytes": lambda: decode_audio_bytes(data, "x.mp3"),
            "file": lambda: decode_audio_file(io.BytesIO(data), "x.mp3")}[via]
    label = f"audio file {path}" if via == "path" else "x.mp3"
    with pytest.raises(InvalidAudioError) as e:
        call()
    assert str(e.value) == (f"cannot decode {label}: the bytes are not a recognised audio format (readable: "
                            f"{audio_mod._READABLE})")


def _fuzz_sources():
    sources = [
        ("wav", encoded(signal(0.5, 22050, 2, 70), 22050, "WAV", "PCM_16")),
        ("flac", encoded(signal(0.5, 48000, 1, 71), 48000, "FLAC", "PCM_16")),
        ("ogg", encoded(signal(0.5, 44100, 1, 72), 44100, "OGG", "VORBIS")),
        ("mp3", encoded(signal(0.5, 44100, 2, 73), 44100, "MP3", "MPEG_LAYER_III")),
    ]
    try:
        import av  # noqa: F401
    except ImportError:
        return sources
    return sources + [("m4a", container("ipod", "aac", 16000, signal(0.5, 16000, 1, 74), "mono"))]


def test_fuzzed_headers_decode_or_raise_audio_decode_errors():
    """A few hundred files with random bytes written over their first 64 bytes (seeded): each decodes to Audio or
    raises an AudioDecodeError (``traced`` lets no other exception through), within the memory bound."""
    rng = np.random.default_rng(22)
    outcomes = {"audio": 0, "error": 0}
    for ext, data in _fuzz_sources():
        for _ in range(64):
            b = bytearray(data)
            for _ in range(int(rng.integers(1, 5))):
                b[int(rng.integers(0, 64))] = int(rng.integers(0, 256))
            result, peak = traced(decode_audio_bytes, bytes(b), f"fuzz.{ext}", 30.0)
            assert isinstance(result, (Audio, AudioDecodeError)), result
            if isinstance(result, Audio):
                outcomes["audio"] += 1
                assert result.samples.dtype == np.float32 and np.isfinite(result.samples).all()
            else:
                outcomes["error"] += 1
                assert str(result)
            seconds = result.duration_s if isinstance(result, Audio) else 30.0
            assert peak <= bound(seconds), (ext, bytes(b[:64]).hex(), peak, seconds)
    assert outcomes["audio"] > 20 and outcomes["error"] > 20, outcomes


# ------------------------------------------------------------------------------- decode_audio_file


@pytest.mark.parametrize("spool", [1 << 30, 1], ids=["in-memory", "rolled-to-disk"])
def test_decode_audio_file_equals_the_bytes(tmp_path, spool):
    """A path, a SpooledTemporaryFile (in memory or rolled over to disk, positioned at its end as an upload
    leaves it: read from byte 0, its position restored) and the bytes decode alike, errors included."""
    data = encoded(signal(2.0, 44100, 2, 80), 44100, "FLAC", "PCM_16")
    ref = decode_audio_bytes(data, "up.flac")
    np.testing.assert_array_equal(ref.samples, reference(data))
    path = tmp_path / "up.flac"
    path.write_bytes(data)
    _same(decode_audio_file(path, "up.flac"), ref)
    _same(decode_audio_file(str(path), "up.flac"), ref)
    assert decode_audio_file(path).source == str(path)
    cut = data[: len(data) // 2]
    with tempfile.SpooledTemporaryFile(max_size=spool) as f:
        f.write(data)
        a = decode_audio_file(f, "up.flac")
        assert f.tell() == len(data) and f._rolled == (spool == 1)
        _same(a, ref)
        assert a.source == "up.flac"
        with pytest.raises(AudioTooLongError) as e:
            decode_audio_file(f, "up.flac", 1.5)
        with pytest.raises(AudioTooLongError) as e_bytes:
            decode_audio_bytes(data, "up.flac", 1.5)
        assert str(e.value) == str(e_bytes.value)
        f.seek(0)
        f.truncate()
        f.write(cut)
        with pytest.raises(TruncatedAudioError) as e:
            decode_audio_file(f, "up.flac", allow_truncated=False)
        with pytest.raises(TruncatedAudioError) as e_bytes:
            decode_audio_bytes(cut, "up.flac", allow_truncated=False)
        assert str(e.value) == str(e_bytes.value)


def test_decode_audio_file_threads_and_containers(monkeypatch):
    """The threaded decode reads a file object through one handle per thread; PyAV reads it as well."""
    monkeypatch.setattr(rs_mod, "PARALLEL_MIN_S", 1.0)
    monkeypatch.setattr(rs_mod, "AUDIO_THREADS", 3)
    calls = []
    original = audio_mod._sf_parallel
    monkeypatch.setattr(audio_mod, "_sf_parallel", lambda *a, **k: calls.append(1) or original(*a, **k))
    data = encoded(signal(6.0, 22050, 2, 81), 22050, "WAV", "PCM_16")
    with tempfile.SpooledTemporaryFile() as f:
        f.write(data)
        _same(decode_audio_file(f, "x"), decode_audio_bytes(data, "x"))
    assert calls == [1, 1]
    np.testing.assert_array_equal(decode_audio_bytes(data).samples, reference(data))
    m4a = container("ipod", "aac", 16000, signal(1.0, 16000, 1, 82), "mono")
    _same(decode_audio_file(io.BytesIO(m4a), "x"), decode_audio_bytes(m4a, "x"))


def test_decode_audio_file_refuses_what_is_not_a_seekable_binary_file(tmp_path):
    data = encoded(signal(0.5, 16000, 1, 83), 16000, "WAV", "PCM_16")
    with pytest.raises(TypeError, match="for bytes use decode_audio_bytes"):
        decode_audio_file(data)
    with pytest.raises(TypeError, match="seekable binary file"):
        decode_audio_file(io.StringIO("RIFF"))

    class Pipe(io.RawIOBase):
        def readable(self):
            return True

        def seekable(self):
            return False

    with pytest.raises(TypeError, match="seekable binary file"):
        decode_audio_file(Pipe())
    with pytest.raises(AudioDecodeError, match="empty"):
        decode_audio_file(io.BytesIO(b""), "e")
    with pytest.raises(audio_mod.AudioError, match="not found"):
        decode_audio_file(tmp_path / "nope.wav")


# ------------------------------------------------------------------------------ streamed resampling


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000, 96000])
def test_streamed_resampling_is_the_one_shot_call_bit_for_bit(monkeypatch, rate):
    """Blocks of 3000 bytes (hundreds of them), each mixed and resampled as it comes, give exactly one soxr call
    over the whole mono mix."""
    monkeypatch.setattr(audio_mod, "READ_BLOCK_BYTES", 3000)
    data = encoded(signal(2.5, rate, 2, 90, scale=0.3), rate, "WAV", "FLOAT")
    np.testing.assert_array_equal(decode_audio_bytes(data).samples, reference(data))
