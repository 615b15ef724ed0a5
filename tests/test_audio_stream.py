"""Live audio input (glmasr/audio/stream.py): the Realtime formats (GA and beta names, the 16 kHz extension, bad
formats named), the streaming decoder pushed in random chunkings (down to 1 byte) bit-identical to ``load_audio`` of
the same samples, odd byte counts across pushes, and G.711 mu-law/A-law against FFmpeg's decoders.

The G.711 test needs the ``ffmpeg`` program (Debian: ``apt-get install -y ffmpeg``).
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from glmasr.audio import load_audio
from glmasr.audio.stream import ALAW_TABLE, MULAW_TABLE, InputFormat, StreamDecoder

FORMATS = [("audio/pcm", 24000), ("audio/pcm", 16000), ("audio/pcmu", 8000), ("audio/pcma", 8000)]


def _signal(n: int, rate: int, rng) -> np.ndarray:
    """int16 noise plus a tone of random frequency, peaking near full scale."""
    t = np.arange(n) / rate
    x = 0.6 * np.sin(2 * np.pi * rng.uniform(100, rate / 3) * t) + 0.3 * rng.standard_normal(n)
    return np.clip(np.round(x * 32767), -32768, 32767).astype(np.int16)


def _clip(fmt: InputFormat, seconds: float, rng) -> tuple[bytes, np.ndarray]:
    """Random raw bytes of ``fmt`` and the int16 samples they stand for (at the format's rate)."""
    n = int(seconds * fmt.rate)
    if fmt.kind == "audio/pcm":
        x = _signal(n, fmt.rate, rng)
        return x.astype("<i2").tobytes(), x
    codes = rng.integers(0, 256, n, dtype=np.uint8)
    table = MULAW_TABLE if fmt.kind == "audio/pcmu" else ALAW_TABLE
    return codes.tobytes(), table[codes]


def _stream(dec: StreamDecoder, data: bytes, sizes) -> np.ndarray:
    out, at = [], 0
    for size in sizes:
        out.append(dec.push(data[at:at + size]))
        at += size
        assert dec.pending_bytes == (at % 2 if dec.format.kind == "audio/pcm" else 0)
    assert at == len(data)
    out.append(dec.flush())
    return np.concatenate(out)


def _random_sizes(total: int, rng, hi: int) -> list[int]:
    sizes = []
    while sum(sizes) < total:
        sizes.append(int(rng.integers(1, hi + 1)))
    sizes[-1] -= sum(sizes) - total
    return [s for s in sizes if s]


# -- formats -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, rate, expected", [
    ("audio/pcm", None, ("audio/pcm", 24000)), ("audio/pcm", 24000, ("audio/pcm", 24000)),
    ("audio/pcm", 16000, ("audio/pcm", 16000)), ("audio/pcmu", None, ("audio/pcmu", 8000)),
    ("audio/pcma", None, ("audio/pcma", 8000)), ("audio/pcmu", 8000, ("audio/pcmu", 8000)),
    ("pcm16", None, ("audio/pcm", 24000)), ("pcm16", 16000, ("audio/pcm", 16000)),
    ("g711_ulaw", None, ("audio/pcmu", 8000)), ("g711_alaw", None, ("audio/pcma", 8000)),
])
def test_formats_parse(kind, rate, expected):
    fmt = InputFormat.parse(kind, rate)
    assert (fmt.kind, fmt.rate) == expected
    assert fmt.bytes_per_sample == (2 if expected[0] == "audio/pcm" else 1)


@pytest.mark.parametrize("kind", ["audio/wav", "pcm24", "PCM16", "", None, 24000, "audio/opus"])
def test_unknown_format_names_field_and_accepted_values(kind):
    with pytest.raises(ValueError) as e:
        InputFormat.parse(kind, field="audio.input.format")
    msg = str(e.value)
    assert msg.startswith("audio.input.format.type:") and repr(kind) in msg
    for accepted in ("audio/pcm", "audio/pcmu", "audio/pcma", "pcm16", "g711_ulaw", "g711_alaw"):
        assert repr(accepted) in msg


@pytest.mark.parametrize("kind, rate, accepted", [
    ("audio/pcm", 48000, "24000 or 16000"), ("audio/pcm", 8000, "24000 or 16000"),
    ("audio/pcm", "24000", "24000 or 16000"), ("audio/pcm", 24000.0, "24000 or 16000"),
    ("audio/pcm", True, "24000 or 16000"), ("pcm16", 44100, "24000 or 16000"),
    ("audio/pcmu", 16000, "8000"), ("g711_alaw", 24000, "8000"),
])
def test_bad_rate_names_field_and_accepted_values(kind, rate, accepted):
    with pytest.raises(ValueError) as e:
        InputFormat.parse(kind, rate, field="input_audio_format")
    msg = str(e.value)
    assert msg.startswith("input_audio_format.rate:") and accepted in msg and repr(rate) in msg


def test_decoder_refuses_other_inputs():
    with pytest.raises(TypeError, match="InputFormat"):
        StreamDecoder("audio/pcm")
    dec = StreamDecoder(InputFormat.parse("audio/pcm"))
    with pytest.raises(TypeError, match="bytes"):
        dec.push("abcd")
    with pytest.raises(TypeError, match="bytes"):
        dec.push(np.zeros(4, np.int16))


# -- streaming == load_audio ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, rate", FORMATS)
def test_chunked_push_is_bit_identical_to_load_audio(kind, rate):
    rng = np.random.default_rng([rate, sum(map(ord, kind))])
    fmt = InputFormat.parse(kind, rate)
    data, samples = _clip(fmt, 2.3, rng)
    want = load_audio(samples, sampling_rate=rate).samples
    assert want.dtype == np.float32 and want.shape[0] == round(samples.shape[0] * 16000 / rate)
    dec = StreamDecoder(fmt)
    chunkings = [[len(data)], _random_sizes(len(data), rng, 61), _random_sizes(len(data), rng, 4801),
                 [1, 2, 3] + _random_sizes(len(data) - 6, rng, 999)]
    for sizes in chunkings:
        got = _stream(dec, data, sizes)  # the decoder is reused: flush() starts it afresh
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind, rate", FORMATS)
def test_one_byte_pushes(kind, rate):
    rng = np.random.default_rng(7 + rate)
    fmt = InputFormat.parse(kind, rate)
    data, samples = _clip(fmt, 0.15, rng)
    got = _stream(StreamDecoder(fmt), data, [1] * len(data))
    np.testing.assert_array_equal(got, load_audio(samples, sampling_rate=rate).samples)


def test_odd_byte_is_kept_and_flush_refuses_it():
    rng = np.random.default_rng(3)
    fmt = InputFormat.parse("audio/pcm", 24000)
    data, samples = _clip(fmt, 0.5, rng)
    dec = StreamDecoder(fmt)
    first = dec.push(data[:1001])
    assert dec.pending_bytes == 1
    with pytest.raises(ValueError, match="odd byte") as e:
        dec.flush()
    assert "audio/pcm" in str(e.value)
    assert dec.pending_bytes == 1  # the failed flush changed nothing: the rest of the clip still decodes exactly
    got = np.concatenate([first, dec.push(data[1001:]), dec.flush()])
    np.testing.assert_array_equal(got, load_audio(samples, sampling_rate=24000).samples)
    dec.push(data[:3])
    dec.reset()  # drops the byte and the resampler's state
    assert dec.pending_bytes == 0
    np.testing.assert_array_equal(_stream(dec, data, [len(data)]), got)


# -- G.711 against FFmpeg -------------------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg is not installed (apt-get install -y ffmpeg)")
@pytest.mark.parametrize("kind, ff", [("audio/pcmu", "mulaw"), ("audio/pcma", "alaw")])
def test_g711_matches_ffmpeg(kind, ff):
    rng = np.random.default_rng(11 if ff == "mulaw" else 12)
    x = _signal(8000 * 2, 8000, rng)
    x[:2000] //= 200  # quiet samples too: the small segments
    run = lambda args, data: subprocess.run(["ffmpeg", "-v", "error", *args], input=data, capture_output=True,
                                            check=True).stdout
    encoded = run(["-f", "s16le", "-ar", "8000", "-ac", "1", "-i", "-", "-f", ff, "-"], x.tobytes())
    encoded += bytes(range(256))  # and every code once
    ref = np.frombuffer(run(["-f", ff, "-ar", "8000", "-ac", "1", "-i", "-", "-f", "s16le", "-"], encoded), "<i2")
    assert ref.shape[0] == len(encoded)
    table = MULAW_TABLE if ff == "mulaw" else ALAW_TABLE
    np.testing.assert_array_equal(table[np.frombuffer(encoded, np.uint8)], ref)
    # the decoder: FFmpeg's 16-bit samples, scaled and resampled as load_audio does, in any chunking
    fmt = InputFormat.parse(kind)
    got = _stream(StreamDecoder(fmt), encoded, _random_sizes(len(encoded), rng, 1500))
    np.testing.assert_array_equal(got, load_audio(ref, sampling_rate=8000).samples)
