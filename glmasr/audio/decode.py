"""Encoded audio (a file, bytes, a seekable file object) -> 16 kHz mono float32 ``Audio``.

- Files are read with ``soundfile`` (libsndfile: wav, flac, ogg/vorbis, opus, mp3 and more), always as float32
  in [-1, 1) whatever the stored PCM format. Containers libsndfile cannot read (MP4/M4A/MOV, WebM/Matroska and
  raw AAC in ADTS: what the OpenAI transcription API accepts besides) are decoded with PyAV, FFmpeg bundled in
  the ``av`` wheel, an optional dependency: ``pip install 'glmasr[containers]'``. The magic bytes pick the
  decoder (never the name: an upload's can lie); a file libsndfile cannot open is given to PyAV as well when it
  is installed.
- A file whose header declares more audio than it holds (a WAV data chunk running past the end of the file, a
  FLAC STREAMINFO, MP3 Xing/Info, MP4 or WebM duration longer than what decodes, a decode error part-way) gives
  what could be decoded, one ``AudioWarning`` naming the file and the missing duration, and ``Audio.truncated``
  / ``Audio.expected_duration_s`` say so. Cut Ogg files, ADTS streams and WAVs with a streaming placeholder size
  declare no length to check against.
- Several channels are averaged to mono and any other sample rate is resampled to 16 kHz (``resampler.py``:
  soxr "HQ").
- Files are decoded in blocks of ``READ_BLOCK_BYTES`` (whatever the channel count), each mixed to mono (the
  float64 channel mean, bit for bit), checked for NaN/inf, counted against the duration limit and resampled to
  16 kHz as it comes (``soxr.ResampleStream``: bit for bit one ``soxr.resample`` call over the whole signal), so
  a file's full-rate signal is never held whole, except where the threads below hold its mono mix at up to
  ``PARALLEL_MAX_RATE`` (48 kHz: at most 3x the 16 kHz output). Long files (>= ``PARALLEL_MIN_S``) in PCM
  wav/aiff, flac or mp3 at up to ``PARALLEL_MAX_RATE`` are decoded on threads, each with its own libsndfile
  handle (these formats seek sample-exactly: bit-equal to one sequential read).
- Limits, checked before a sample is decoded (a WAV's from its own header, even where libsndfile would refuse
  it): a sample rate in [``MIN_FILE_RATE``, ``MAX_FILE_RATE``] = [1000, 384000] Hz and at most
  ``MAX_FILE_CHANNELS`` = 64 channels (7th-order ambisonics; 22.2 sound is 24; FLAC stops at 8), else
  ``UnsupportedAudioError`` (code ``unsupported_audio``, naming the field and the limit).
- Memory of one decode (a file, bytes or a file object, to 16 kHz mono): peak <= input bytes + 3 x D + C, where
  D is the decoded 16 kHz mono float32 (64,000 bytes per second of audio; with ``max_duration_s``, at most that
  many seconds and one frame) and C = 4 MiB (a read block, its float64 mix, a resampled piece, soxr's and the
  codec's state) + 1.5 MiB per decode thread (long files only). The 3 x D is the threaded decode (the mono mix
  held at up to 48 kHz until resampled, then the output); a sequential decode needs 2 x D (the output's pieces,
  then their join). Input bytes: what the caller holds (``bytes``; a spooled upload still in memory; a path or a
  file on disk costs none), twice for in-memory audio up to ``NATIVE_COPY_MAX_BYTES`` (16 MiB) on Linux, which
  libsndfile gets as a memfd copy so that it reads natively instead of through Python callbacks (each takes the
  GIL; ``_Source.sf_target``). PyAV adds FFmpeg's own buffers: its probe window (up to ~5 MB), a packet and one
  decoded codec frame (frames of more than ``MAX_CODEC_FRAME_SAMPLES`` samples are refused). ``read_file``
  returns the full-rate signal and so holds it.
- Bad input (missing/corrupt file, empty audio, NaN/inf, a bad sample rate) raises ``AudioError`` naming it.
- Bytes in memory (an upload: ``decode_audio_bytes``) and seekable binary file objects (``decode_audio_file``,
  e.g. a spooled upload, read in place) take the same path as files: the format from the magic bytes, the same
  decoders, truncation checks, limits and threads. Encoded audio that cannot be used raises an
  ``AudioDecodeError`` whose ``code`` says why (``empty_file``, ``invalid_audio``, ``unsupported_format``,
  ``unsupported_audio``, ``audio_too_long``); a duration limit is checked against the header first, then while
  decoding, which stops one frame past the limit. A FLAC whose STREAMINFO declares no length (as FFmpeg writes
  to a pipe) is decoded to its end, counted against the limit as it goes.
"""

from __future__ import annotations

import io
import math
import os
import struct
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import (AudioDecodeError, AudioError, AudioTooLongError, AudioWarning, EmptyAudioFileError,
                      InvalidAudioError, TruncatedAudioError, UnsupportedAudioError, UnsupportedFormatError)
from . import resampler as _rs
from .features import SAMPLE_RATE

MIN_FILE_RATE = 1000  # files and uploads: sample rates outside [MIN_FILE_RATE, MAX_FILE_RATE] are refused
MAX_FILE_RATE = 384_000
MAX_FILE_CHANNELS = 64  # files and uploads: more channels are refused
MAX_CODEC_FRAME_SAMPLES = 1 << 17  # PyAV: decoded codec frames (per channel) above this are refused

PARALLEL_MAX_RATE = 48000  # threaded decode only up to this rate (it holds the mono mix at the file's rate)
READ_BLOCK_BYTES = 1 << 19  # float32 bytes (all channels) per file read block: bounds a block whatever the channels
SALVAGE_READ_FRAMES = 256  # read size when recovering what precedes damage without libsndfile's own read call
DECODE_BLOCKS_PER_THREAD = 4
LOSSY_TOLERANCE_S = 0.05  # shortfall against a lossy header's duration still counted as whole (codec frames)

_PCM_CONTAINERS = {"WAV", "WAVEX", "RF64", "W64", "AIFF", "CAF", "AU"}
_PCM_SUBTYPES = {"PCM_S8", "PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT", "DOUBLE", "ULAW", "ALAW"}
_EXACT_SEEK_FORMATS = {"FLAC", "MP3"}  # besides uncompressed PCM: libsndfile seeks these sample-exactly
_LOSSLESS_FORMATS = _PCM_CONTAINERS | {"FLAC", "W64"}
_UNKNOWN_FRAMES = 1 << 62  # a frame count from libsndfile at or above this means "unknown" (its SF_COUNT_MAX)
NATIVE_COPY_MAX_BYTES = 16 << 20  # in-memory audio up to this size is copied into a memfd for libsndfile (below)
_WAV_MAX_CHUNKS = 4096  # RIFF chunks walked looking for fmt/data (a file of tiny chunks must not cost seconds)


@dataclass
class Audio:
    """16 kHz mono float32 samples and where they came from (for messages).

    ``expected_duration_s``: the duration a file's header declares (None for arrays, or a file that declares none
    this reader trusts); ``truncated``: the file holds less than that, or decoding failed part-way (the samples are
    what could be decoded; an ``AudioWarning`` was issued)."""

    samples: np.ndarray
    source: str
    expected_duration_s: float | None = None
    truncated: bool = False

    @property
    def duration_s(self) -> float:
        return self.samples.shape[0] / SAMPLE_RATE

    @property
    def missing_s(self) -> float:
        """Seconds the header declares beyond what was decoded (0.0 when complete or unknown)."""
        if self.expected_duration_s is None:
            return 0.0
        return max(0.0, self.expected_duration_s - self.duration_s)


# ---------------------------------------------------------------------------------------------------- files


class _FileView:
    """An own read position over a caller's seekable binary file, shared with other views under one lock (each
    read is a seek then a read), so the header parsers, libsndfile, PyAV and the decode threads each get a handle
    onto a spooled upload without a copy of its bytes."""

    def __init__(self, file, lock: threading.Lock, size: int):
        self._file, self._lock, self._size, self._pos = file, lock, size, 0

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = max(0, self._size - self._pos)
        with self._lock:
            self._file.seek(self._pos)
            data = self._file.read(n)
        if not isinstance(data, bytes):
            if not isinstance(data, (bytearray, memoryview)):
                raise TypeError(f"the file must be opened in binary mode (its read gave {type(data).__name__})")
            data = bytes(data)
        self._pos += len(data)
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence not in (io.SEEK_SET, io.SEEK_CUR, io.SEEK_END):
            raise ValueError(f"invalid whence ({whence})")
        pos = int(offset) + (0, self._pos, self._size)[whence]
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _Source:
    """Encoded audio to decode: a file (``path``), bytes in memory (``data``) or a caller's seekable binary file
    object (``file``, read from its byte 0); ``label`` names it in messages. Every ``open`` / ``target`` is a fresh
    handle, so the threaded decode and the recovery read get their own. ``close`` releases what ``sf_target``
    made."""

    def __init__(self, label: str, path: Path | None = None, data: bytes | None = None, file=None):
        self.label, self.path, self.data, self.file = label, path, data, file
        self._native: str | None | bool = False  # sf_target's path once made (None: none can be)
        self._memfd: int | None = None
        self._native_lock = threading.Lock()
        if file is not None:
            self._lock = threading.Lock()
            file.seek(0, io.SEEK_END)
            self._size = file.tell()

    @property
    def size(self) -> int:
        if self.file is not None:
            return self._size
        return self.path.stat().st_size if self.data is None else len(self.data)

    def open(self):
        """A binary file object (for the header parsers)."""
        if self.file is not None:
            return _FileView(self.file, self._lock, self._size)
        return open(self.path, "rb") if self.data is None else io.BytesIO(self.data)

    def target(self):
        """What PyAV opens: the path (its native I/O is faster), a BytesIO sharing the bytes or a view of the file
        object."""
        if self.path is not None:
            return str(self.path)
        return self.open()

    def sf_target(self):
        """What libsndfile opens: a path wherever one can be had (``native_path``), else ``target()``.

        Why: libsndfile reads a Python file object through callbacks, each of which must take the GIL. In a server
        whose event loop keeps the GIL busy, every callback waits up to the interpreter's switch interval for it
        (notes/measurements.md, thirteenth session). With a path it reads natively and needs the GIL only when a
        block is handed back."""
        native = self.native_path()
        return native if native is not None else self.target()

    def native_path(self) -> str | None:
        """A file path onto exactly these bytes, opened afresh by every reader (own position), or None: the file
        itself; else (Linux) ``/proc/self/fd/N`` of a spooled upload already on disk (a rolled-over
        ``SpooledTemporaryFile``, flushed first) or of a caller's file opened on a regular file, and otherwise a
        memfd holding a copy of bytes in memory up to ``NATIVE_COPY_MAX_BYTES`` (so an in-memory decode holds its
        input twice, bounded by that)."""
        if self.path is not None:
            return str(self.path)
        if self._native is not False:
            return self._native
        with self._native_lock:
            if self._native is False:
                try:
                    self._native = self._make_native()
                except (OSError, ValueError, AttributeError):
                    self._native = None
        return self._native

    def _make_native(self) -> str | None:
        if not (hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")):
            return None
        buf = self.data
        if self.file is not None:
            import tempfile

            f = self.file
            inner = f._file if isinstance(f, tempfile.SpooledTemporaryFile) else f
            # a file on disk (a rolled-over spool is a BufferedRandom here); not any object with a fileno(): a
            # GzipFile's would be its compressed file
            if isinstance(inner, (io.BufferedReader, io.BufferedRandom, io.FileIO)):
                with self._lock:
                    f.flush()
                    fd = inner.fileno()
                import stat

                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_size == self._size:
                    return f"/proc/self/fd/{fd}"
                return None
            if not isinstance(inner, io.BytesIO) or self._size > NATIVE_COPY_MAX_BYTES:
                return None
            buf = inner.getbuffer()
        if buf is None or len(buf) > NATIVE_COPY_MAX_BYTES:
            return None
        fd = os.memfd_create("glmasr-audio", getattr(os, "MFD_CLOEXEC", 0))
        try:
            view, done = memoryview(buf), 0
            while done < len(view):
                done += os.write(fd, view[done:])
        except OSError:
            os.close(fd)
            raise
        finally:
            if isinstance(buf, memoryview):
                buf.release()
        self._memfd = fd
        return f"/proc/self/fd/{fd}"

    def close(self) -> None:
        """Release the memfd ``native_path`` made (if any)."""
        with self._native_lock:
            if self._memfd is not None:
                os.close(self._memfd)
                self._memfd = None
            self._native = False


@dataclass
class _Decoded:
    """What a file decoded to: ``data`` (16 kHz mono float32 when decoded ``mono``, else (frames, channels) at the
    file's rate), the file's ``rate`` and the ``frames`` decoded at that rate, the frame count its header declares
    (None: it declares none we trust), the error that stopped decoding part-way (None: it decoded to its end), the
    shortfall tolerated before the file counts as truncated, its format, and how many of its (mono) samples were
    NaN or infinite (a mono decode keeps nothing after the first)."""

    data: np.ndarray
    rate: int
    frames: int
    expected_frames: int | None = None
    error: str | None = None
    tolerance_frames: int = 0
    format: str | None = None
    nonfinite: int = 0

    @property
    def truncated(self) -> bool:
        if self.error is not None:
            return True
        return self.expected_frames is not None and self.frames < self.expected_frames - self.tolerance_frames

    @property
    def expected_duration_s(self) -> float | None:
        return None if self.expected_frames is None else self.expected_frames / self.rate


def _err_text(e: BaseException) -> str:
    for attr in ("error_string", "strerror"):  # soundfile's and PyAV's errors without the file name / errno
        text = getattr(e, attr, None)
        if isinstance(text, str) and text.strip():
            return text.strip()
    text = str(e).strip()
    if text:
        return text
    code = getattr(e, "code", None)
    return f"{type(e).__name__}" + (f" (code {code})" if code is not None else "")


def _limit_frames(max_s: float | None, rate: int) -> int | None:
    return None if max_s is None else int(math.floor(max_s * rate))


def _block_frames(channels: int) -> int:
    """Frames per read block: ``READ_BLOCK_BYTES`` of float32 whatever the channel count (at least one frame), and
    at most ``READ_BLOCK_FRAMES``."""
    return max(1, min(_rs.READ_BLOCK_FRAMES, READ_BLOCK_BYTES // (4 * max(1, channels))))


def _too_long(label: str, fmt: str, limit_s: float, duration_s: float | None = None,
              decoded_s: float | None = None) -> AudioTooLongError:
    if duration_s is not None:
        msg = f"{label}: the {fmt} audio is {duration_s:.1f} s long (its header says), over the limit of {limit_s:g} s"
    else:
        msg = (f"{label}: the {fmt} audio is longer than the limit of {limit_s:g} s (decoding stopped after "
               f"{decoded_s:.2f} s)")
    return AudioTooLongError(msg, format=fmt, limit_s=limit_s, duration_s=duration_s, decoded_s=decoded_s)


def _check_params(label: str, fmt: str | None, rate: int | None, channels: int | None) -> None:
    """Refuse, before anything is decoded, a sample rate or channel count (None: not known yet) outside what this
    reader decodes."""
    if rate is not None and rate > MAX_FILE_RATE:
        raise UnsupportedAudioError(f"{label}: sample rate {rate} Hz is above the limit of {MAX_FILE_RATE} Hz",
                                    format=fmt, field="sample_rate", value=rate, limit=MAX_FILE_RATE)
    if rate is not None and rate < MIN_FILE_RATE:
        raise UnsupportedAudioError(f"{label}: sample rate {rate} Hz is below the minimum of {MIN_FILE_RATE} Hz",
                                    format=fmt, field="sample_rate", value=rate, limit=MIN_FILE_RATE)
    if channels is not None and channels > MAX_FILE_CHANNELS:
        raise UnsupportedAudioError(f"{label}: {channels} channels are more than the limit of {MAX_FILE_CHANNELS}",
                                    format=fmt, field="channels", value=channels, limit=MAX_FILE_CHANNELS)
    if channels is not None and channels < 1:
        raise InvalidAudioError(f"cannot decode {label}: it declares no audio channels", format=fmt)


class _Sink:
    """Where decoded blocks go, in order. ``mono``: each block is mixed to mono, checked for NaN/inf, counted
    against the limit and resampled to 16 kHz as it comes (``soxr.ResampleStream``, bit for bit one
    ``soxr.resample`` call over the whole signal), so only the 16 kHz output is kept. Else (``read_file``) blocks
    are kept as they are, counted against the limit."""

    def __init__(self, label: str, fmt: str, rate: int, channels: int, mono: bool, max_s: float | None):
        self.label, self.fmt, self.rate, self.channels, self.mono, self.max_s = label, fmt, rate, channels, mono, max_s
        self.limit = _limit_frames(max_s, rate)
        self.frames = self.nonfinite = 0
        self._chunks: list[np.ndarray] = []
        self._stream = None
        if mono and rate != SAMPLE_RATE:
            import soxr

            self._stream = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")

    def put(self, block: np.ndarray) -> None:
        """(frames, channels) float32, possibly a view of a read buffer that is reused."""
        if not self.mono:
            self.put_mixed(block.copy())
            return
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf in the file: counted and refused, not warned
            self.put_mixed(_rs.mix(block))

    def put_mixed(self, m: np.ndarray) -> None:
        """A block already mixed (mono) or copied (not mono), the sink's to keep."""
        n = m.shape[0]
        if not n:
            return
        self.frames += n
        if self.limit is not None and self.frames > self.limit:
            raise _too_long(self.label, self.fmt, self.max_s, decoded_s=self.frames / self.rate)
        if not self.mono:
            self._chunks.append(m)
            return
        finite = np.isfinite(m)
        if not finite.all():
            self.nonfinite += n - int(np.count_nonzero(finite))
        if self.nonfinite:  # refused once decoded: only counted from here on
            self._chunks.clear()
            return
        self._chunks.append(m if self._stream is None else self._stream.resample_chunk(m))

    def result(self) -> np.ndarray:
        if self._stream is not None and not self.nonfinite:
            self._chunks.append(self._stream.resample_chunk(np.zeros(0, np.float32), last=True))
        chunks, self._chunks = self._chunks, []
        if not chunks:
            return np.zeros(0 if self.mono else (0, self.channels), np.float32)
        return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)


class _Blocks(list):
    """A decode thread's blocks, mixed (or copied) out of its read buffer, for the ``_Sink`` to take in order."""

    def __init__(self, mono: bool):
        super().__init__()
        self.mono = mono

    def put(self, block: np.ndarray) -> None:
        if not self.mono:
            self.append(block.copy())
            return
        with np.errstate(invalid="ignore", over="ignore"):
            self.append(_rs.mix(block))


@dataclass
class _WavHeader:
    """What a RIFF/RF64 WAVE header says: the fmt chunk's fields (None where there is none), the frames it declares
    (see ``_wav_header``) and whether the data chunk runs past the end of the file."""

    tag: int | None = None
    channels: int | None = None
    rate: int | None = None
    bits: int | None = None
    frames: int | None = None
    past_end: bool = False


def _wav_header(src: _Source) -> _WavHeader | None:
    """The WAV header (None when it is no RIFF/RF64 WAVE). Frames: data bytes / block align for PCM, float, A-law,
    mu-law and extensible; the fact chunk's count for other (compressed) codecs; None when neither is known, the
    data chunk is not found within the first ``_WAV_MAX_CHUNKS`` chunks, or its size is a streaming placeholder (0
    with data after it, or >= 0x7FFF0000 bytes in a plain RIFF: what writers to a pipe leave, since they cannot go
    back to fix it; a truly cut WAV of more than 2 GiB goes unnoticed)."""
    try:
        size = src.size
        with src.open() as fh:
            head = fh.read(12)
            if len(head) < 12 or head[:4] not in (b"RIFF", b"RF64", b"BW64") or head[8:12] != b"WAVE":
                return None
            rf64 = head[:4] != b"RIFF"
            h = _WavHeader()
            pos, ds64_data, block_align, fact = 12, None, 0, None
            for _ in range(_WAV_MAX_CHUNKS):
                if pos + 8 > size:
                    break
                fh.seek(pos)
                ck = fh.read(8)
                if len(ck) < 8:
                    break
                cid, csize = ck[:4], struct.unpack("<I", ck[4:])[0]
                body = pos + 8
                if cid == b"ds64":
                    d = fh.read(24)
                    if len(d) == 24:
                        ds64_data = struct.unpack("<QQQ", d)[1]
                elif cid == b"fmt " and h.tag is None:
                    d = fh.read(16)
                    if len(d) >= 14:
                        h.tag, h.channels, h.rate, _byte_rate, block_align = struct.unpack("<HHIIH", d[:14])
                        h.bits = struct.unpack("<H", d[14:16])[0] if len(d) == 16 else None
                elif cid == b"fact":
                    d = fh.read(4)
                    if len(d) == 4:
                        fact = struct.unpack("<I", d)[0]
                elif cid == b"data":
                    if rf64 and csize == 0xFFFFFFFF:  # the real size is in the ds64 chunk
                        csize = ds64_data
                    present = size - body
                    if csize is None or (csize > present and not rf64 and csize >= 0x7FFF0000):
                        return h
                    if csize == 0 and present > 0:  # a placeholder left at 0
                        return h
                    if h.tag in (1, 3, 6, 7, 0xFFFE) and block_align:
                        h.frames = csize // block_align
                    else:
                        h.frames = fact
                    h.past_end = csize > present
                    return h
                pos = body + csize + (csize & 1)
            return h
    except OSError:
        return None


def _sf_read(f, count: int | None, sink, frames_per_block: int) -> tuple[int, str | None]:
    """Up to ``count`` frames (None: to the end) from an open SoundFile's position into ``sink``, through one read
    buffer of ``frames_per_block`` frames; returns (frames read, the error that stopped it or None)."""
    buf = np.empty((frames_per_block, f.channels), np.float32)
    got = 0
    while count is None or got < count:
        n = frames_per_block if count is None else min(frames_per_block, count - got)
        try:
            b = f.read(n, dtype="float32", always_2d=True, out=buf[:n])
        except Exception as e:
            return got, _err_text(e)
        if not len(b):
            break
        sink.put(b)
        got += len(b)
    return got, None


def _sf_raw_reader(f, buf: np.ndarray):
    """``read(n) -> (frames, error text or None)`` into ``buf`` through libsndfile's own read call: soundfile's
    ``read`` drops a whole block when anything fails after libsndfile decoded it (the damage in a cut FLAC; or its
    position update, which fails at the end of a FLAC whose STREAMINFO gives no length, as FFmpeg writes to a pipe,
    so the last block would be lost). With a soundfile whose internals differ: its ``read``, in small reads."""
    try:
        from soundfile import _ffi, _snd

        handle = f._file
        ptr = _ffi.cast("float *", buf.__array_interface__["data"][0])
    except (ImportError, AttributeError):
        def public(n: int) -> tuple[int, str | None]:
            try:
                return len(f.read(min(n, SALVAGE_READ_FRAMES), dtype="float32", always_2d=True, out=buf[:n])), None
            except Exception as e:
                return 0, _err_text(e)

        return public

    def raw(n: int) -> tuple[int, str | None]:
        k = max(0, int(_snd.sf_readf_float(handle, ptr, n)))
        err = _snd.sf_error(handle)
        return k, (_ffi.string(_snd.sf_error_number(err)).decode(errors="replace").strip() if err else None)

    return raw


def _sf_recover(src: _Source, start: int, stop: int | None, sink: _Sink, frames_per_block: int) -> str | None:
    """After a read failed at frame ``start``: the rest (up to ``stop``) read again from there on a fresh handle,
    keeping every frame libsndfile decodes before any damage. Returns the error that ended it (None: a clean end of
    the stream; so a FLAC of unknown length gives all its samples)."""
    import soundfile as sf

    try:
        f = sf.SoundFile(src.sf_target())
    except Exception as e:
        return _err_text(e)
    with f:
        try:
            if start:
                f.seek(start)
        except Exception as e:
            return _err_text(e)
        buf = np.empty((frames_per_block, f.channels), np.float32)
        read, got = _sf_raw_reader(f, buf), start
        while stop is None or got < stop:
            k, error = read(frames_per_block if stop is None else min(frames_per_block, stop - got))
            if k:
                sink.put(buf[:k])
                got += k
            if error is not None:
                return error
            if not k:
                break
    return None


def _sf_read_range(src: _Source, start: int, stop: int | None, mono: bool, frames_per_block: int):
    import soundfile as sf

    blocks = _Blocks(mono)
    try:
        with sf.SoundFile(src.sf_target()) as f:
            if start:
                f.seek(start)  # fails past the end of a cut file
            got, error = _sf_read(f, None if stop is None else stop - start, blocks, frames_per_block)
            return blocks, got, error
    except Exception as e:
        return blocks, 0, _err_text(e)


def _sf_parallel(src: _Source, frames: int, threads: int, stop: int | None, frames_per_block: int,
                 sink: _Sink) -> int | None:
    """The file decoded in ranges on ``threads`` threads, each with its own handle (libsndfile runs without the
    GIL), the ranges' mono blocks given to ``sink`` in order as each range completes (so resampling overlaps the
    decoding of later ranges). A range's blocks are held at the file's rate until the sink has taken them: at most
    the whole mono signal (the caller uses this only up to ``PARALLEL_MAX_RATE``). The last range reads to the
    end (or to ``stop``). Returns the frames decoded; None if any range came back short or failed (a truncated
    file, a wrong frame count): the sink has then taken part of the audio, and the caller decodes sequentially
    into a fresh one, which finds where the damage is."""
    nblocks = max(threads, min(threads * DECODE_BLOCKS_PER_THREAD, frames // (4 * _rs.READ_BLOCK_FRAMES)))
    bounds = [round(i * frames / nblocks) for i in range(nblocks)] + [stop]
    with ThreadPoolExecutor(min(threads, nblocks)) as pool:
        futures = [pool.submit(_sf_read_range, src, bounds[i], bounds[i + 1], sink.mono, frames_per_block)
                   for i in range(nblocks)]
        try:
            for i, future in enumerate(futures):
                blocks, got, error = future.result()
                futures[i] = None  # the range's blocks go with the sink from here
                last = i == nblocks - 1
                if error is not None or (last and got == 0) or (not last and got != bounds[i + 1] - bounds[i]):
                    return None
                blocks.reverse()
                while blocks:  # each full-rate block is dropped once the sink has it
                    sink.put_mixed(blocks.pop())
            return sink.frames
        finally:
            for future in futures:
                if future is not None:
                    future.cancel()


def _sf_decode(src: _Source, mono: bool, max_s: float | None, wav: _WavHeader | None) -> _Decoded:
    """libsndfile. Raises _NotSoundfile when it cannot open the file at all (another decoder may)."""
    import soundfile as sf

    try:
        f = sf.SoundFile(src.sf_target())
    except Exception as e:
        raise _NotSoundfile(_err_text(e)) from None
    with f:
        rate, channels, frames = int(f.samplerate), int(f.channels), int(f.frames)
        fmt, subtype = f.format, f.subtype
        name = f"{fmt}/{subtype}"
        _check_params(src.label, name, rate, channels)  # before a sample is decoded
        # a FLAC whose STREAMINFO gives no length (written to a pipe) shows as libsndfile's SF_COUNT_MAX
        unknown = not 0 <= frames < _UNKNOWN_FRAMES
        limit = _limit_frames(max_s, rate)
        # libsndfile's count: trimmed to the bytes present for WAV, an estimate for MP3 without a Xing header (so
        # MP3 is only limited while decoding); lossy counts may include a codec frame of padding
        slack = 0 if fmt in _LOSSLESS_FORMATS else int(LOSSY_TOLERANCE_S * rate)
        if limit is not None and not unknown and fmt != "MP3" and frames - slack > limit:
            raise _too_long(src.label, name, max_s, duration_s=frames / rate)
        stop = None if limit is None else limit + 1  # one frame past the limit is enough to refuse
        per_block = _block_frames(channels)
        sink = _Sink(src.label, name, rate, channels, mono, max_s)
        threads = _rs.threads()
        done, error = None, None
        if (threads > 1 and not unknown and rate <= PARALLEL_MAX_RATE and f.seekable()
                and frames >= _rs.PARALLEL_MIN_S * rate and (limit is None or frames <= limit)
                and (fmt in _EXACT_SEEK_FORMATS or (fmt in _PCM_CONTAINERS and subtype in _PCM_SUBTYPES))):
            done = _sf_parallel(src, frames, threads, stop, per_block, sink)
            if done is None:
                sink = _Sink(src.label, name, rate, channels, mono, max_s)
        if done is None:
            got, error = _sf_read(f, stop, sink, per_block)
            if error is not None:
                error = _sf_recover(src, got, stop, sink, per_block)
    data = sink.result()
    if fmt in ("WAV", "WAVEX", "RF64"):  # libsndfile trims its count to the bytes present: the header's instead
        expected, past_end = (wav.frames, wav.past_end) if wav is not None else (None, False)
        tolerance = 0
        if past_end and expected is None and error is None:  # a compressed codec without a fact chunk
            error = "its data chunk declares more bytes than the file holds"
    elif fmt == "MP3":  # the Xing/Info header's count is exact; without one libsndfile's count is an estimate
        expected, tolerance = frames, int(LOSSY_TOLERANCE_S * rate) + frames // 100
    else:
        expected, tolerance = frames, slack
    if unknown or (expected is not None and expected <= 0):
        expected = None
    return _Decoded(data, rate, sink.frames, expected, error, tolerance, name, sink.nonfinite)


class _NotSoundfile(Exception):
    pass


_SOUNDFILE_MAGIC = (b"RIFF", b"RF64", b"BW64", b"fLaC", b"OggS", b"FORM", b"ID3", b".snd", b"caff", b"riff")
_QUICKTIME_ATOMS = (b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot")  # first atoms of MOVs without ftyp
_READABLE = ("wav, flac, ogg (vorbis/opus), mp3, aiff; with PyAV (pip install 'glmasr[containers]') also "
             "mp4/m4a/mov, webm/mkv and aac")


def _sniff_container(head: bytes) -> str | None:
    """The kind of container libsndfile cannot read (decoded with PyAV), from the magic bytes alone (a name can
    lie); None for libsndfile's formats and for bytes that say nothing (libsndfile, then PyAV, try those)."""
    if head.startswith(_SOUNDFILE_MAGIC):
        return None
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in (b"M4A ", b"M4B ", b"M4P "):
            return "M4A"
        if brand == b"qt  ":
            return "QuickTime"
        return "3GP" if brand[:3] in (b"3gp", b"3g2") else "MP4"
    if head[4:8] in _QUICKTIME_ATOMS:
        return "QuickTime"
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML; the DocType element follows within the first bytes
        return "WebM" if b"webm" in head[:64] else "Matroska"
    if len(head) >= 2 and head[0] == 0xFF and (head[1] & 0xF6) == 0xF0:  # ADTS sync: 12 one bits, layer 00
        return "AAC (ADTS)"
    return None


def _av_declared_s(container, stream) -> float | None:
    """The duration an MP4/MOV (per-stream duration in the moov) or Matroska/WebM (segment duration) header
    declares, in seconds; None for streams whose duration FFmpeg can only estimate (ADTS: from the bit rate)."""
    names = set(container.format.name.split(","))
    if names & {"mov", "mp4", "m4a", "3gp"}:
        if stream.duration and stream.time_base:
            return float(stream.duration * stream.time_base)
    elif names & {"matroska", "webm"}:
        if container.duration:
            return container.duration / 1_000_000
    return None


def _av_frame_length(cc) -> int | None:
    """The samples per codec frame a stream's header sets, where the codec lets it be huge: ALAC's magic cookie
    (up to 4096 x 4096 samples; encoders write 4096). None for the other codecs (their frames are small)."""
    if cc.name != "alac":
        return None
    extra = bytes(cc.extradata or b"")
    cookie = extra[12:] if extra[4:8] == b"alac" else extra  # the 'alac' atom, or the bare 24-byte cookie
    return struct.unpack(">I", cookie[:4])[0] if len(cookie) >= 24 else None


def _av_decode(src: _Source, kind: str, mono: bool, max_s: float | None) -> _Decoded:
    try:
        import av
    except ImportError:
        raise UnsupportedFormatError(f"cannot decode {src.label}: {kind} files are decoded with PyAV, which is not "
                                     f"installed: pip install 'glmasr[containers]' (or pip install av)",
                                     format=kind) from None
    try:
        container = av.open(src.target(), "r")
    except Exception as e:
        hint = (" (a cut MP4/M4A/MOV file loses its index, which most writers put at the end)"
                if kind in ("MP4", "M4A", "QuickTime", "3GP") else "")
        raise InvalidAudioError(f"cannot decode {src.label}: {_err_text(e)}{hint}", format=kind) from None
    with container:
        try:
            stream = container.streams.audio[0] if container.streams.audio else None
            cc = None if stream is None else stream.codec_context
            container_name = container.format.name
            declared_s = None if cc is None else _av_declared_s(container, stream)
            frame_length = None if cc is None else _av_frame_length(cc)
            header_rate, header_channels = (0, 0) if cc is None else (int(cc.sample_rate or 0), int(cc.channels or 0))
        except Exception as e:
            raise InvalidAudioError(f"cannot decode {src.label}: {_err_text(e)}", format=kind) from None
        if stream is None:
            raise InvalidAudioError(f"cannot decode {src.label}: it has no audio stream", format=kind)
        if cc is None:  # e.g. a WAV with a format tag FFmpeg does not know
            raise InvalidAudioError(f"cannot decode {src.label}: FFmpeg has no decoder for its audio codec",
                                    format=kind)
        name = f"{kind if kind != 'audio' else container_name} ({cc.name})"
        _check_params(src.label, name, header_rate or None, header_channels or None)  # 0: known once decoded
        if frame_length is not None and frame_length > MAX_CODEC_FRAME_SAMPLES:
            raise UnsupportedAudioError(f"{src.label}: codec frames of {frame_length} samples are more than the "
                                        f"limit of {MAX_CODEC_FRAME_SAMPLES}", format=name, field="frame_samples",
                                        value=frame_length, limit=MAX_CODEC_FRAME_SAMPLES)
        if max_s is not None and declared_s is not None and declared_s - LOSSY_TOLERANCE_S > max_s:
            raise _too_long(src.label, name, max_s, duration_s=declared_s)
        # sample format only (same layout and rate: no resampling), to packed float32: PyAV's planar arrays
        # (fltp) read past the frame's plane pointers from 8 channels on (a 7.1 AAC crashed the process)
        resampler = av.AudioResampler(format="flt")
        sink: _Sink | None = None
        pending, pending_bytes, got, error, rate, channels, limit = [], 0, 0, None, None, None, None

        def flush():
            nonlocal pending, pending_bytes
            if pending:
                block = pending[0] if len(pending) == 1 else np.concatenate(pending)  # (frames, channels)
                pending, pending_bytes = [], 0
                sink.put(block)

        def check(fr):
            """A decoded frame, before it is converted: the same rate and layout throughout, within the limits."""
            nonlocal sink, rate, channels, limit
            fr_rate, fr_channels = int(fr.sample_rate), len(fr.layout.channels)
            if rate is None:
                _check_params(src.label, name, fr_rate, fr_channels)
                rate, channels, limit = fr_rate, fr_channels, _limit_frames(max_s, fr_rate)
                sink = _Sink(src.label, name, rate, channels, mono, max_s)
            elif fr_rate != rate or fr_channels != channels:
                raise InvalidAudioError(f"cannot decode {src.label}: the stream changes from {rate} Hz, "
                                        f"{channels} channels to {fr_rate} Hz, {fr_channels} channels", format=name)
            if fr.samples > MAX_CODEC_FRAME_SAMPLES:
                raise UnsupportedAudioError(f"{src.label}: a codec frame of {fr.samples} samples is more than the "
                                            f"limit of {MAX_CODEC_FRAME_SAMPLES}", format=name,
                                            field="frame_samples", value=fr.samples, limit=MAX_CODEC_FRAME_SAMPLES)

        def take(frames):
            nonlocal pending_bytes, got
            for fr in frames:
                a = fr.to_ndarray().reshape(-1, channels)  # packed: (1, frames x channels)
                pending.append(a)
                pending_bytes += a.nbytes
                got += a.shape[0]
                if limit is not None and got > limit:  # stop here: the rest is never decoded
                    raise _too_long(src.label, name, max_s, decoded_s=got / rate)
                if pending_bytes >= READ_BLOCK_BYTES:
                    flush()

        try:
            for frame in container.decode(stream):
                check(frame)
                take(resampler.resample(frame))
            if rate is not None:
                take(resampler.resample(None))
        except AudioError:
            raise
        except Exception as e:
            error = _err_text(e)
        flush()
        if sink is None:
            if error is not None:
                raise InvalidAudioError(f"cannot decode {src.label}: {error}", format=name)
            if header_rate <= 0:
                raise InvalidAudioError(f"cannot decode {src.label}: the audio stream has no sample rate",
                                        format=name)
            rate, channels = header_rate, max(1, header_channels)
            sink = _Sink(src.label, name, rate, channels, mono, max_s)
        expected = None if declared_s is None else int(round(declared_s * rate))
    return _Decoded(sink.result(), rate, sink.frames, expected, error, int(LOSSY_TOLERANCE_S * rate), name,
                    sink.nonfinite)


def _decode(src: _Source, mono: bool, max_s: float | None = None) -> _Decoded:
    """The one decoder of files and bytes: the magic bytes pick PyAV (containers) or libsndfile, whose failures go
    to PyAV too when it is installed. Sample rate and channels are checked before anything is decoded (a WAV's
    from its header, even where libsndfile refuses it). ``max_s``: raise AudioTooLongError past that many
    seconds."""
    try:
        return _decode_source(src, mono, max_s)
    finally:
        src.close()


def _decode_source(src: _Source, mono: bool, max_s: float | None) -> _Decoded:
    try:
        with src.open() as fh:
            head = fh.read(64)
    except OSError as e:
        raise AudioError(f"cannot read {src.label}: {_err_text(e)}") from None
    if not head:
        raise EmptyAudioFileError(f"cannot decode {src.label}: the file is empty (0 bytes)")
    kind = _sniff_container(head)
    if kind is not None:
        return _av_decode(src, kind, mono, max_s)
    wav = _wav_header(src) if head[:4] in (b"RIFF", b"RF64", b"BW64") else None
    if wav is not None and wav.rate is not None:
        _check_params(src.label, "WAV", wav.rate, wav.channels)
    try:
        return _sf_decode(src, mono, max_s, wav)
    except _NotSoundfile as e:
        if head.startswith(_SOUNDFILE_MAGIC):  # a known magic: damaged, or a codec libsndfile lacks
            detail = ""
            if wav is not None and wav.tag is not None:
                detail = (f" (WAV format tag 0x{wav.tag:04X}, {wav.bits} bits per sample, {wav.channels} "
                          f"channel{'' if wav.channels == 1 else 's'}, {wav.rate} Hz)")
            unknown = InvalidAudioError(f"cannot decode {src.label}: {e}{detail}")
        else:  # libsndfile's own words here can mislead ("does not exist or is not a regular file")
            unknown = InvalidAudioError(f"cannot decode {src.label}: the bytes are not a recognised audio format "
                                        f"(readable: {_READABLE})")
    try:  # a format libsndfile does not know: FFmpeg may (when PyAV is installed)
        import av  # noqa: F401
    except ImportError:
        raise unknown from None
    try:
        return _av_decode(src, "audio", mono, max_s)
    except (AudioTooLongError, UnsupportedAudioError):
        raise
    except AudioDecodeError:
        raise unknown from None


def _decode_path(path: str | os.PathLike, mono: bool, max_s: float | None = None) -> _Decoded:
    p = Path(path).expanduser()
    if not p.exists():
        raise AudioError(f"audio file not found: {p}")
    if p.is_dir():
        raise AudioError(f"audio path is a folder, not a file: {p}")
    return _decode(_Source(f"audio file {p}", path=p), mono, max_s)


def _truncation_message(source: str, dec: _Decoded) -> str:
    got = dec.frames / dec.rate
    if dec.expected_frames is not None and dec.frames < dec.expected_frames:
        exp = dec.expected_frames / dec.rate
        msg = (f"{source}: truncated audio file: its header declares {exp:.2f} s but only {got:.2f} s could be "
               f"decoded ({exp - got:.2f} s missing)")
    else:
        msg = f"{source}: audio file is damaged or truncated: decoding stopped after {got:.2f} s"
    return msg + (f" ({dec.error})" if dec.error else "")


def _decoded_audio(dec: _Decoded, source: str, sampling_rate: int | None, allow_truncated: bool) -> Audio:
    """A mono decode of a file or bytes -> ``Audio`` (rate check, truncation warning or refusal, the sample
    checks; the samples are already 16 kHz)."""
    if sampling_rate is not None and int(sampling_rate) != dec.rate:
        raise AudioError(f"{source}: file is {dec.rate} Hz but sampling_rate={sampling_rate} was given")
    if dec.truncated:
        if dec.frames == 0:
            declared = "" if dec.expected_frames is None else f" (its header declares {dec.expected_duration_s:.2f} s)"
            raise InvalidAudioError(f"{source}: audio is empty: nothing could be decoded, the file is truncated or "
                                    f"damaged{declared}" + (f" ({dec.error})" if dec.error else ""), format=dec.format)
        if not allow_truncated:
            raise TruncatedAudioError(_truncation_message(source, dec), format=dec.format)
        warnings.warn(_truncation_message(source, dec), AudioWarning, stacklevel=3)  # the caller of load_audio
    if dec.frames == 0:
        raise InvalidAudioError(f"{source}: audio is empty (0 samples)", format=dec.format)
    if dec.nonfinite:
        raise InvalidAudioError(f"{source}: audio has {dec.nonfinite} NaN or infinite samples", format=dec.format)
    samples = np.ascontiguousarray(dec.data, dtype=np.float32)
    return Audio(samples=samples, source=source, expected_duration_s=dec.expected_duration_s, truncated=dec.truncated)


def read_file(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """A file's samples as float32 ((frames,) mono or (frames, channels)) and its rate, unmixed and not resampled
    (so held whole at the file's rate; the sample rate and channel limits apply). A truncated file gives what could
    be decoded and an ``AudioWarning``."""
    dec = _decode_path(path, mono=False)
    data = dec.data[:, 0] if dec.data.ndim == 2 and dec.data.shape[1] == 1 else dec.data
    if dec.truncated and dec.frames:
        warnings.warn(_truncation_message(str(Path(path).expanduser()), dec), AudioWarning, stacklevel=2)
    return data, dec.rate


def decode_audio_bytes(data: bytes | bytearray | memoryview, name: str = "audio bytes",
                       max_duration_s: float | None = None, *, allow_truncated: bool = True) -> Audio:
    """Encoded audio in memory (an upload) -> 16 kHz mono ``Audio``: sample for sample what ``load_audio`` gives
    for the same bytes in a file (one code path: format sniffing, decoders, threads, checks).

    The format comes from the bytes; ``name`` only names the audio in messages and ``Audio.source``.
    ``max_duration_s`` (None: no limit): longer audio raises ``AudioTooLongError``, from the header where it
    declares a duration this reader trusts (not MP3's estimate, not ADTS), else while decoding, which stops one
    frame past the limit: nothing after it is decoded. ``allow_truncated=False`` refuses a stream shorter than its
    header declares or damaged part-way (``TruncatedAudioError``) instead of using what decodes with an
    ``AudioWarning``. Memory: see the module's docstring (a bytearray or memoryview is copied once, to a fixed
    ``bytes``; ``bytes`` are not).

    Raises (all ``AudioDecodeError``, by ``code``): ``EmptyAudioFileError`` (empty_file: no bytes),
    ``InvalidAudioError`` (invalid_audio: not audio, corrupt, nothing decoded, NaN/inf; ``TruncatedAudioError``),
    ``UnsupportedFormatError`` (unsupported_format: a container without PyAV installed),
    ``UnsupportedAudioError`` (unsupported_audio: a sample rate or channel count outside the limits, refused
    before decoding), ``AudioTooLongError`` (audio_too_long)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{name}: decode_audio_bytes takes bytes, got {type(data).__name__}")
    _check_max_duration(max_duration_s)
    data = bytes(data)  # the same object for bytes; a fixed copy of a mutable buffer
    dec = _decode(_Source(name, data=data), mono=True, max_s=max_duration_s)
    return _decoded_audio(dec, name, None, allow_truncated)


def decode_audio_file(file, name: str | None = None, max_duration_s: float | None = None, *,
                      allow_truncated: bool = True) -> Audio:
    """Encoded audio in a file -> 16 kHz mono ``Audio``, as ``decode_audio_bytes`` decodes the same bytes (same
    samples, flags, errors and limits). ``file``: a path, or a seekable binary file object (e.g. an upload
    spooled to a ``tempfile.SpooledTemporaryFile``) read in place from its byte 0 whatever its position, which is
    restored afterwards; no copy of its bytes is made. ``name`` names it in messages and ``Audio.source`` (default:
    the path, or the object's ``name`` when it is a string, else "audio file"). A path that does not exist or is a
    folder raises ``AudioError``; an object that is not a seekable binary file, ``TypeError``."""
    _check_max_duration(max_duration_s)
    if isinstance(file, (str, os.PathLike)):
        p = Path(file).expanduser()
        label = str(p) if name is None else name
        if not p.exists():
            raise AudioError(f"audio file not found: {p}")
        if p.is_dir():
            raise AudioError(f"audio path is a folder, not a file: {p}")
        dec = _decode(_Source(label, path=p), mono=True, max_s=max_duration_s)
        return _decoded_audio(dec, label, None, allow_truncated)
    if isinstance(file, (bytes, bytearray, memoryview)):
        raise TypeError("decode_audio_file takes a path or a binary file object; for bytes use decode_audio_bytes")
    if not all(callable(getattr(file, a, None)) for a in ("read", "seek", "tell")) or isinstance(file, io.TextIOBase) \
            or (callable(getattr(file, "seekable", None)) and not file.seekable()):
        raise TypeError(f"decode_audio_file takes a path or a seekable binary file object, got "
                        f"{type(file).__name__}")
    label = name if name is not None else (file.name if isinstance(getattr(file, "name", None), str)
                                           else "audio file")
    try:
        position = file.tell()
    except (OSError, ValueError) as e:
        raise AudioError(f"cannot read {label}: {_err_text(e)}") from None
    try:
        dec = _decode(_Source(label, file=file), mono=True, max_s=max_duration_s)
    finally:
        try:
            file.seek(position)
        except (OSError, ValueError):
            pass
    return _decoded_audio(dec, label, None, allow_truncated)


def _check_max_duration(max_duration_s) -> None:
    if max_duration_s is not None and not max_duration_s > 0:
        raise ValueError(f"max_duration_s must be a positive number of seconds or None, got {max_duration_s!r}")
