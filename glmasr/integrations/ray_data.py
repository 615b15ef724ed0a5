"""Ray Data: transcribe a dataset of audio with one loaded model per actor.

    import ray
    from glmasr.integrations.ray_data import GlmAsrPredictor

    ds = ray.data.read_binary_files("s3://bucket/audio/", include_paths=True)     # columns: bytes, path
    ds = ds.map_batches(GlmAsrPredictor, fn_constructor_kwargs={"model": "zai-org/GLM-ASR-Nano-2512"},
                        batch_size=32, num_gpus=1, concurrency=8)
    ds.write_parquet("s3://bucket/transcripts/")

Each actor loads the model once (``__init__``); each batch's rows are decoded on a few threads and submitted to
the actor's engine together, so they decode as one batch (continuous batching), exactly as
``glmasr.transcribe`` of those rows would.

Input rows: the audio column (``audio_column``; default the first of ``bytes``, ``audio``, ``array``, ``path``
that the batch has) holds, per row, one of

- bytes: an encoded file (wav, flac, ogg, mp3, ...; m4a/webm/aac with the ``containers`` extra), as
  ``ray.data.read_binary_files`` gives;
- a str: a local file path (or one on a file system every node mounts);
- a numeric array of samples (1-D, or (frames, channels)), with the rate in the ``sampling_rate`` column or the
  ``sampling_rate=`` argument;
- a dict ``{"array": samples, "sampling_rate": rate}`` (or ``{"bytes": ...}`` / ``{"path": ...}``), as Hugging
  Face datasets' audio feature gives.

Output rows: the input's columns (without the audio column, unless it is the path column or
``keep_audio=True``), plus ``text`` (str), ``segments`` (a list of ``{"id", "start", "end", "text", "tokens",
"finish_reason", "compression_ratio", ...}``: ``glmasr.Segment``'s fields, ``token_ids`` as ``tokens``), ``duration_s``, ``finish_reason``, ``num_windows``, the timings
``audio_ms``, ``encoder_ms``, ``decoder_ms``, ``total_ms`` (per row, from ``Transcription.timings_ms``) and
``error``: None, or why that row has no transcript (it could not be decoded, or failed in the engine). A bad row
never fails its batch; its ``text``, ``finish_reason``, ``duration_s`` and timings are null, its ``segments``
empty. The batch comes back as
a ``pyarrow.Table`` (Ray Data's own block format, so the column types are fixed whatever the rows hold).

This module does not import Ray: Ray calls the class.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

AUDIO_COLUMNS = ("bytes", "audio", "array", "path")
TIMING_COLUMNS = ("audio_ms", "encoder_ms", "decoder_ms", "total_ms")


class GlmAsrPredictor:
    """A callable class for ``Dataset.map_batches`` (see the module docstring for the rows in and out).

    model / device / dtype / max_batch: as ``glmasr.load`` (device default: CUDA if the actor has a GPU).
    audio_column: which column holds the audio (default: the first of ``AUDIO_COLUMNS`` present).
    sampling_rate: the rate of array rows when the batch has no ``sampling_rate_column``.
    name_column: a column naming each row in error messages (default ``path``; else "row N").
    prompt / hotwords / max_new_tokens / segmentation / repetition_stop: the decoding options (as the CLI's;
    segmentation "windows" by default, "vad" needs the ``vad`` extra). keep_audio: keep the audio column in the
    output (bytes and arrays are dropped by default). decode_threads: rows decoded at once.
    warmup: capture every CUDA graph at start (``GlmAsr.warmup``), so the first batches run at full speed.
    """

    def __init__(self, model=None, device=None, dtype=None, audio_column: str | None = None,
                 sampling_rate: int | None = None, sampling_rate_column: str = "sampling_rate",
                 name_column: str = "path", prompt: str | None = None, hotwords: list[str] | None = None,
                 max_new_tokens: int | None = None, segmentation: str = "windows",
                 repetition_stop: int | None = None, keep_audio: bool = False, decode_threads: int = 4,
                 max_batch: int | None = None, warmup: bool = False):
        import glmasr
        from glmasr.checkpoint.tokenizer import build_instruction
        from glmasr.checkpoint.weights import DEFAULT_MODEL_ID

        self.decode = glmasr.DecodeOptions(prompt=build_instruction(prompt, list(hotwords or [])),
                                           max_new_tokens=max_new_tokens, segmentation=segmentation,
                                           repetition_stop=repetition_stop)
        self.audio_column = audio_column
        self.sampling_rate = sampling_rate
        self.sampling_rate_column = sampling_rate_column
        self.name_column = name_column
        self.keep_audio = keep_audio
        options = {"max_batch": max_batch} if max_batch else {}
        self.asr = glmasr.load(model if model is not None else DEFAULT_MODEL_ID, device=device, dtype=dtype,
                               warmup=warmup, **options)
        self._pool = ThreadPoolExecutor(max(1, decode_threads), thread_name_prefix="glmasr-ray-decode")

    # ---- rows in ----
    def _pick_column(self, columns: dict) -> str:
        if self.audio_column is not None:
            if self.audio_column not in columns:
                raise KeyError(f"audio_column {self.audio_column!r} is not in the batch (columns: "
                               f"{', '.join(columns)})")
            return self.audio_column
        for name in AUDIO_COLUMNS:
            if name in columns:
                return name
        raise KeyError(f"no audio column in the batch (columns: {', '.join(columns)}): name one with "
                       f"audio_column=, or use one of {', '.join(AUDIO_COLUMNS)}")

    def _decode_row(self, value, rate, name: str):
        """(Audio, None, ms) or (None, error message, ms): one row's audio as 16 kHz mono samples."""
        from glmasr.audio import load_audio

        t0 = time.perf_counter()
        try:
            audio = self._to_audio(value, rate, name, load_audio)
        except Exception as e:  # noqa: BLE001 - this row's problem, reported in its error column
            return None, f"{name}: {e}" if name not in str(e) else str(e), 1e3 * (time.perf_counter() - t0)
        return audio, None, 1e3 * (time.perf_counter() - t0)

    def _to_audio(self, value, rate, name: str, load_audio):
        if isinstance(value, dict):  # Hugging Face datasets' audio feature
            if value.get("array") is not None:
                return self._to_audio(np.asarray(value["array"]), value.get("sampling_rate", rate), name,
                                      load_audio)
            if value.get("bytes") is not None:
                return self._to_audio(value["bytes"], rate, name, load_audio)
            if value.get("path") is not None:
                return self._to_audio(value["path"], rate, name, load_audio)
            raise ValueError("the audio dict has none of array, bytes, path")
        if value is None:
            raise ValueError("no audio (the value is null)")
        if isinstance(value, (bytes, bytearray, memoryview)):
            return _decode_bytes(bytes(value), name, load_audio)
        if isinstance(value, (str, os.PathLike)):
            return load_audio(value)
        if isinstance(value, np.ndarray) and value.dtype == object:
            value = np.asarray(list(value))  # a ragged column's row: an array of arrays or numbers
        if isinstance(value, (np.ndarray, list)):
            if rate is None or (isinstance(rate, float) and math.isnan(rate)):
                raise ValueError(f"array audio needs a rate: a {self.sampling_rate_column!r} column or "
                                 f"sampling_rate= in fn_constructor_kwargs")
            return load_audio(np.asarray(value), int(rate), source=name)
        raise TypeError(f"unsupported audio value of type {type(value).__name__}: bytes, a path, or an array")

    # ---- the batch ----
    def __call__(self, batch):
        columns = _as_columns(batch)
        n = len(next(iter(columns.values()))) if columns else 0
        audio_col = self._pick_column(columns)
        names = columns.get(self.name_column)
        rates = columns.get(self.sampling_rate_column)
        values = columns[audio_col]

        def name(i):
            return str(names[i]) if names is not None and names[i] is not None else f"row {i}"

        t0 = time.perf_counter()
        decoded = list(self._pool.map(
            lambda i: self._decode_row(values[i], rates[i] if rates is not None else self.sampling_rate, name(i)),
            range(n)))
        errors: list[str | None] = [err for _, err, _ in decoded]
        results: list = [None] * n
        jobs = {}
        try:
            for i, (audio, err, ms) in enumerate(decoded):  # all rows first, then wait: one engine batch
                if audio is None:
                    continue
                try:
                    jobs[i] = self.asr.submit_loaded(audio, self.decode, i, t0, ms)
                except Exception as e:  # noqa: BLE001 - e.g. audio too short for one token
                    errors[i] = f"{name(i)}: {e}"
            decoded = None  # the samples belong to the jobs now
            for i, job in jobs.items():
                try:
                    results[i] = job.result()
                except Exception as e:  # noqa: BLE001 - failed in the engine: this row alone
                    errors[i] = f"{name(i)}: {type(e).__name__}: {e}"
        finally:
            for job in jobs.values():
                job.abort()  # no-op when finished
        return self._output(columns, audio_col, results, errors)

    def _output(self, columns: dict, audio_col: str, results: list, errors: list):
        import pyarrow as pa

        out = {}
        for k, v in columns.items():
            if k == audio_col and not self.keep_audio and k != self.name_column:
                continue
            out[k] = _to_arrow(v)
        out["text"] = pa.array([r.text if r else None for r in results], pa.string())
        out["segments"] = pa.array([[_segment_dict(s) for s in r.segments] if r else [] for r in results],
                                   segments_type())
        out["duration_s"] = pa.array([r.duration_s if r else None for r in results], pa.float64())
        out["finish_reason"] = pa.array([r.finish_reason if r else None for r in results], pa.string())
        out["num_windows"] = pa.array([r.num_windows if r else 0 for r in results], pa.int64())
        for key in TIMING_COLUMNS:
            out[key] = pa.array([r.timings_ms.get(key) if r else None for r in results], pa.float64())
        out["error"] = pa.array(errors, pa.string())
        return pa.table(out)

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)


@functools.lru_cache(maxsize=None)
def _segment_fields() -> tuple[tuple[str, str, str], ...]:
    """(output name, ``Segment`` field, its type) for each field of ``glmasr.Segment`` (``token_ids`` is written
    ``tokens``, as in the json writer), so the column follows the dataclass."""
    import dataclasses

    from glmasr.results import Segment

    return tuple(("tokens" if f.name == "token_ids" else f.name, f.name, str(f.type))
                 for f in dataclasses.fields(Segment) if str(f.type) in _KINDS)


_KINDS = ("int", "float", "str", "list[int]")  # the field types the column carries (all Segment has today)


def segments_type():
    """The Arrow type of the ``segments`` column: a list of structs with ``Segment``'s fields."""
    import pyarrow as pa

    kinds = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "list[int]": pa.list_(pa.int64())}
    return pa.list_(pa.struct([(name, kinds[kind]) for name, _, kind in _segment_fields()]))


def _segment_dict(s) -> dict:
    convert = {"int": int, "float": float, "str": str, "list[int]": lambda v: [int(t) for t in v]}
    return {name: convert[kind](getattr(s, field)) for name, field, kind in _segment_fields()}


def _as_columns(batch) -> dict:
    """A batch in any of Ray's formats (dict of numpy arrays, pandas DataFrame, pyarrow Table) -> dict of
    per-row sequences."""
    if isinstance(batch, dict):
        return dict(batch)
    if hasattr(batch, "to_pydict") and hasattr(batch, "schema"):  # pyarrow.Table
        return batch.to_pydict()
    if hasattr(batch, "columns") and hasattr(batch, "iloc"):  # pandas.DataFrame
        return {c: batch[c].to_numpy() for c in batch.columns}
    raise TypeError(f"unsupported batch type {type(batch).__name__}: a dict of arrays, a pandas DataFrame or a "
                    f"pyarrow Table")


def _to_arrow(values):
    """A passed-through input column as an Arrow array (tensor columns through Ray's tensor extension)."""
    import pyarrow as pa

    if isinstance(values, np.ndarray) and values.ndim > 1:
        from ray.data.extensions import ArrowTensorArray

        return ArrowTensorArray.from_numpy(values)
    if isinstance(values, np.ndarray) and values.dtype == object:
        values = list(values)
    if isinstance(values, list) and values and isinstance(values[0], np.ndarray):
        values = [v.tolist() for v in values]
    return pa.array(values)


def _decode_bytes(data: bytes, name: str, load_audio):
    """Encoded audio in memory -> Audio: ``glmasr.audio.decode_audio_bytes`` where this glmasr has it, else the
    same bytes through a temporary file (``load_audio``)."""
    from glmasr import audio as audio_mod

    decode = getattr(audio_mod, "decode_audio_bytes", None)
    if decode is not None:
        return decode(data, name)
    suffix = os.path.splitext(name)[1] if "." in os.path.basename(name) else ""
    fd, tmp = tempfile.mkstemp(prefix="glmasr-ray-", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        try:
            audio = load_audio(tmp)
        except audio_mod.AudioError as e:
            raise audio_mod.AudioError(str(e).replace(tmp, name)) from None
        audio.source = name
        return audio
    finally:
        os.unlink(tmp)
