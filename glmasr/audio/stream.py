"""Live audio in: the raw sample formats of OpenAI's Realtime protocol (``InputFormat``) and a streaming decoder to
16 kHz mono float32 (``StreamDecoder``).

Formats (``InputFormat.parse``):

- ``audio/pcm``: 16-bit signed little-endian mono PCM at 24 kHz (OpenAI's rate), or at 16 kHz (``rate: 16000``, our
  extension for vLLM/Riva-style clients that send the model's own rate).
- ``audio/pcmu`` / ``audio/pcma``: G.711 mu-law / A-law, one byte per sample at 8 kHz.
- The beta names: ``pcm16`` (24 kHz; a ``rate`` of 16000 allowed as for ``audio/pcm``), ``g711_ulaw``,
  ``g711_alaw``.

Anything else is a ``ValueError`` naming the field and the accepted values.

Decoding (``StreamDecoder``): bytes -> samples in [-1, 1) (16-bit PCM divided by 32768; G.711 through the ITU-T
G.711 expansion, computed below from the standard's segment/quantisation rule and checked against FFmpeg's
``pcm_mulaw``/``pcm_alaw`` decoders in the tests), then resampled to 16 kHz with a streaming soxr "HQ" resampler
set up as the file decoder's (``decode._Sink``). soxr's stream gives, bit for bit, what one ``soxr.resample`` call
over the whole signal gives, so a clip pushed in any chunking followed by ``flush()`` equals
``load_audio(samples at the format's rate, sampling_rate=rate).samples`` exactly (for arrays shorter than
``resampler.PARALLEL_MIN_S``; longer ones may be resampled on threads by ``load_audio`` on hosts with at least
``resampler.RESAMPLE_MIN_CPUS`` CPUs, within float32 rounding of one call). The resampler holds back a few
milliseconds of output until more input (or ``flush``) comes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .features import SAMPLE_RATE

PCM16_RATES = (24000, 16000)  # 24 kHz: OpenAI's; 16 kHz: our extension (the model's own rate)
G711_RATE = 8000

# Accepted ``type`` values -> (canonical kind, default rate). The GA names first (what messages list first).
_KINDS = {
    "audio/pcm": ("audio/pcm", 24000),
    "audio/pcmu": ("audio/pcmu", G711_RATE),
    "audio/pcma": ("audio/pcma", G711_RATE),
    "pcm16": ("audio/pcm", 24000),
    "g711_ulaw": ("audio/pcmu", G711_RATE),
    "g711_alaw": ("audio/pcma", G711_RATE),
}


@dataclass(frozen=True)
class InputFormat:
    """A live input format: ``kind`` is the canonical GA name ("audio/pcm", "audio/pcmu", "audio/pcma"), ``rate``
    its sample rate in Hz (24000 or 16000 for PCM, 8000 for G.711). Build it with ``parse``."""

    kind: str
    rate: int

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.kind == "audio/pcm" else 1

    @classmethod
    def parse(cls, kind, rate=None, field: str = "format") -> InputFormat:
        """The format for a ``type`` string (GA or beta name) and an optional ``rate``.

        ``field`` names the setting in error messages (e.g. "audio.input.format" or "input_audio_format"): an
        unknown ``kind`` raises ``ValueError("<field>.type: ...")``, a rate the kind does not have
        ``ValueError("<field>.rate: ...")``, each listing what is accepted."""
        if not isinstance(kind, str) or kind not in _KINDS:
            accepted = ", ".join(repr(k) for k in _KINDS)
            raise ValueError(f"{field}.type: unsupported audio format {kind!r}; accepted: {accepted}")
        canonical, default = _KINDS[kind]
        if rate is None:
            return cls(canonical, default)
        allowed = PCM16_RATES if canonical == "audio/pcm" else (G711_RATE,)
        if isinstance(rate, bool) or not isinstance(rate, int) or rate not in allowed:
            accepted = " or ".join(str(r) for r in allowed)
            raise ValueError(f"{field}.rate: {kind!r} audio must have rate {accepted} (Hz), got {rate!r}")
        return cls(canonical, int(rate))


def _mulaw_table() -> np.ndarray:
    """ITU-T G.711 mu-law expansion of the 256 codes to 16-bit linear values (the standard's 14-bit values, << 2).

    A code is transmitted inverted; its bits are then sign (1 = negative), a 3-bit segment e and a 4-bit step m.
    In the 14-bit scale segment e's 16 steps are 2^(e+1) apart: |x| = (2m + 33) 2^e - 33 (the bias of 33 makes
    the segments join, and code 0 of segment 0 zero); x 4 for 16 bits: (((m << 3) + 132) << e) - 132."""
    v = np.arange(256, dtype=np.int32) ^ 0xFF
    e, m = (v >> 4) & 7, v & 0x0F
    mag = (((m << 3) + 132) << e) - 132
    return np.where(v & 0x80, -mag, mag).astype(np.int16)


def _alaw_table() -> np.ndarray:
    """ITU-T G.711 A-law expansion of the 256 codes to 16-bit linear values (the standard's 13-bit values, << 3).

    A code is transmitted with its even bits inverted (XOR 0x55); its bits are then sign (1 = positive), a 3-bit
    segment e and a 4-bit step m. Segment 0 is linear (steps of 2 in the 13-bit scale, decoded at the middle of
    the step: 2m + 1); segment e >= 1 covers [2^(e+4), 2^(e+5)) in steps of 2^e (decoded as (2m + 33) * 2^(e-1)).
    In 16-bit (x 8): e = 0 -> 16m + 8; e >= 1 -> (16m + 264) << (e - 1)."""
    v = np.arange(256, dtype=np.int32) ^ 0x55
    e, m = (v >> 4) & 7, v & 0x0F
    mag = np.where(e == 0, (m << 4) + 8, ((m << 4) + 264) << np.maximum(e - 1, 0))
    return np.where(v & 0x80, mag, -mag).astype(np.int16)


# float32 samples for each code, the int16 value / 32768 as ``load_audio`` scales int16 PCM.
MULAW_TABLE = _mulaw_table()
ALAW_TABLE = _alaw_table()
_MULAW_F32 = MULAW_TABLE.astype(np.float32) / np.float32(32768)
_ALAW_F32 = ALAW_TABLE.astype(np.float32) / np.float32(32768)


class StreamDecoder:
    """Raw live audio (``InputFormat``) -> 16 kHz mono float32, chunk by chunk.

    ``push(data)`` returns the 16 kHz samples that are ready (possibly none: the resampler holds a few ms back).
    16-bit PCM: a chunk may end inside a sample; its odd byte is kept for the next push (``pending_bytes`` says 1).
    ``flush()`` returns the rest (the resampler's tail) and starts afresh, as if a new clip began: the concatenation
    of everything pushed and flushed equals ``load_audio`` of the clip's samples (see the module docstring);
    ``flush()`` with an odd byte left raises ``ValueError`` naming it and changes nothing (push the missing byte,
    or ``reset()``). ``reset()`` drops the pending byte and the resampler's state. ``max_output(n)`` bounds what
    the audio held back plus ``n`` more input samples become (a caller checking a buffer limit before a push)."""

    def __init__(self, fmt: InputFormat):
        if not isinstance(fmt, InputFormat):
            raise TypeError(f"StreamDecoder needs an InputFormat (InputFormat.parse(...)), got {type(fmt).__name__}")
        self.format = fmt
        self._odd = b""
        self._stream = None
        self._new_stream()

    def _new_stream(self) -> None:
        self._in = self._out = 0  # input and output samples since the stream began (what is held back)
        self._stream = None
        if self.format.rate != SAMPLE_RATE:
            import soxr

            # as decode._Sink sets it up for files: its output is one soxr.resample call's, bit for bit
            self._stream = soxr.ResampleStream(self.format.rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")

    def max_output(self, incoming: int) -> int:
        """At most how many 16 kHz samples the audio held back plus ``incoming`` more input samples become."""
        return math.ceil((self._in + incoming) * SAMPLE_RATE / self.format.rate) + 1 - self._out

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete sample held for the next push (0 or 1; always 0 for G.711)."""
        return len(self._odd)

    def _samples(self, data) -> np.ndarray:
        if isinstance(data, memoryview):
            data = data.tobytes()
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"audio chunks must be bytes, got {type(data).__name__}")
        if self.format.kind == "audio/pcmu":
            return _MULAW_F32[np.frombuffer(data, np.uint8)]
        if self.format.kind == "audio/pcma":
            return _ALAW_F32[np.frombuffer(data, np.uint8)]
        if self._odd:
            data = self._odd + bytes(data)
        whole = len(data) & ~1
        self._odd = bytes(data[whole:])
        # int16 / 32768 is exact in float32, so this is load_audio's float64 division rounded to float32
        return np.frombuffer(data, "<i2", count=whole // 2).astype(np.float32) * np.float32(1 / 32768)

    def push(self, data) -> np.ndarray:
        """Raw bytes of the format -> the 16 kHz float32 samples ready so far (a new array)."""
        x = self._samples(data)
        self._in += x.shape[0]
        if self._stream is not None:
            x = self._stream.resample_chunk(x) if x.shape[0] else np.zeros(0, np.float32)
        self._out += x.shape[0]
        return x

    def flush(self) -> np.ndarray:
        """The resampler's remaining output; the decoder then starts afresh. ``ValueError`` if half a 16-bit sample
        is pending (nothing is changed then)."""
        if self._odd:
            raise ValueError(f"{self.format.kind} audio ends with an odd byte: 16-bit PCM needs an even byte count "
                             f"(1 byte of an incomplete sample is pending)")
        if self._stream is None:
            return np.zeros(0, np.float32)
        tail = self._stream.resample_chunk(np.zeros(0, np.float32), last=True)
        self._new_stream()
        return tail

    def reset(self) -> None:
        """Forget the pending byte and the resampler's state (e.g. after a cleared buffer)."""
        self._odd = b""
        self._new_stream()
