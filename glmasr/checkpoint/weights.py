"""Finding a checkpoint and loading its tensors into our model.

A checkpoint is a folder with ``config.json``, ``model.safetensors`` (or shards plus
``model.safetensors.index.json``) and the tokenizer files. ``resolve_checkpoint`` accepts such a folder, a
Hugging Face hub id (downloaded into the normal HF cache by ``huggingface_hub.snapshot_download``), or the name
``tiny-random``: a tiny random-weight checkpoint built once into the user cache (``random_checkpoint.py``), so
every entry point (``glmasr.load``, the CLIs, the server, ``DevicePool``) accepts it.

These key layouts are accepted and mapped onto our module names (``canonical_name``):
- shipped (the Hub file; also what transformers 5.24 ``save_pretrained`` writes): ``audio_tower.*``,
  ``multi_modal_projector.*``, ``language_model.model.*``, ``language_model.lm_head.weight``
- transformers 5.17 ``save_pretrained``: as shipped, but the decoder one level deeper,
  ``language_model.model.model.*`` (its renaming table for this model holds two rules that both rename
  ``language_model.model``, and saving reverses both); lm head as shipped
- transformers' runtime names (``state_dict()`` of ``GlmAsrForConditionalGeneration``): ``model.audio_tower.*``,
  ``model.multi_modal_projector.*``, ``model.language_model.*``, ``lm_head.weight``
``save_pretrained`` leaves the lm head out when it is tied (``tie_word_embeddings``, the GLM-ASR default); a
missing lm head is tied to the token embeddings.

Loading (``load_state_dict``): names, shapes and byte ranges are checked from the safetensors headers first;
then the tensor bytes go to the target device and are cast to the target dtype there; no second model is
ever materialised. On CUDA the files are streamed in large chunks through pinned staging buffers (threaded
reads, double-buffered non-blocking copies); on the CPU safetensors reads them tensor by tensor. Both are
bit-identical (tests).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models.config import GlmAsrConfig
from ..errors import CheckpointError

DEFAULT_MODEL_ID = "zai-org/GLM-ASR-Nano-2512"
# The name of the offline smoke-test checkpoint (random weights, built on first use); it is looked up before
# folders, so a folder of that name is passed as ./tiny-random.
TINY_RANDOM = "tiny-random"

# (checkpoint prefix, our prefix); the first match wins, so a prefix comes before every shorter one it extends
# ("language_model.model.model." before "language_model.model.").
_PREFIXES = [
    ("language_model.model.model.", "language_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model."),
    ("model.audio_tower.", "audio_tower."),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "language_model."),
    ("multi_modal_projector.", "multi_modal_projector."),
    ("audio_tower.", "audio_tower."),
    ("lm_head.", "lm_head."),
]
# Present in some exports, unused by the model (Whisper's absolute positions; GLM-ASR uses RoPE).
_IGNORED = {"audio_tower.embed_positions.weight"}


def canonical_name(key: str) -> str | None:
    for src, dst in _PREFIXES:
        if key.startswith(src):
            return dst + key[len(src):]
    return None


def looks_like_hub_id(s: str) -> bool:
    """'owner/name' that is not a path on this machine."""
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "/", "~")) and not os.path.exists(s)


def tiny_random_checkpoint(folder: str | os.PathLike | None = None, log=None) -> Path:
    """The ``tiny-random`` checkpoint's folder (``random_checkpoint.ensure_tiny_checkpoint``: built on first use
    into ``folder``, default the user cache; ``log(message)`` is called before a build). CheckpointError naming
    GLMASR_CACHE_DIR when it cannot be written."""
    from .random_weights import ensure_tiny_checkpoint

    try:
        return ensure_tiny_checkpoint(folder, log=log)
    except OSError as e:
        raise CheckpointError(f"cannot build the tiny random checkpoint ({e}); set GLMASR_CACHE_DIR to a "
                              f"writable folder") from None


def resolve_checkpoint(model: str | os.PathLike, log=None) -> Path:
    """Local folder for ``model``: ``tiny-random`` (built once, see ``tiny_random_checkpoint``; ``log`` as
    there), the folder itself, or a hub snapshot (cached copy first, then network)."""
    if isinstance(model, str) and model == TINY_RANDOM:
        return tiny_random_checkpoint(log=log)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    if path.exists():
        raise CheckpointError(f"model path {text!r} is a file; pass the checkpoint folder that holds config.json")
    if not looks_like_hub_id(text):
        raise CheckpointError(f"model {text!r} is neither an existing folder nor a Hugging Face hub id "
                              f"('owner/name')")
    try:
        return hub_snapshot(text, ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "tokenizer*"])
    except Exception as e:  # network errors, offline mode, gated repos: all end the same way for the user
        raise CheckpointError(
            f"could not get {text!r} from the Hugging Face hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}).\n"
            f"No network and no cached copy? Pass a local checkpoint folder instead, e.g.\n"
            f"  glmasr --model /path/to/GLM-ASR-Nano-2512   or   glmasr.load('/path/to/GLM-ASR-Nano-2512')\n"
            f"(download it where there is network with `hf download {text} --local-dir weights/GLM-ASR-Nano-2512`:\n"
            f"glmasr finds that folder under the working directory by itself),\n"
            f"or run offline with random weights: glmasr --model tiny-random"
        ) from None


# safetensors dtype codes -> torch dtypes (those torch has; others are refused with the file and tensor named).
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
for _code, _name in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _name):
        _ST_DTYPES[_code] = getattr(torch, _name)
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, from its header: bytes [begin, end) of the file (absolute offsets)."""

    path: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse a safetensors file's header (8-byte little-endian length, JSON) and check every tensor's dtype,
    shape and byte range against each other and the file size. CheckpointError naming the file otherwise."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > _MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"cannot read {path}: not a safetensors file or truncated "
                                      f"(header length {n}, file size {size} bytes)")
            text = f.read(n).decode("utf-8").lstrip()
            # writers pad the header (spaces; some NULs) to align the data: only padding may follow the JSON
            header, end = json.JSONDecoder().raw_decode(text)
            if text[end:].strip(" \t\r\n\x00"):
                raise CheckpointError(f"cannot read {path}: bytes after the JSON header (header length {n}): "
                                      f"{text[end:end + 40]!r}")
    except CheckpointError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"cannot read {path}: the header is not a JSON object")
    base = 8 + n
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            code, shape, (b, e) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            b, e = int(b), int(e)
        except (TypeError, KeyError, ValueError) as err:
            raise CheckpointError(f"cannot read {path}: malformed header entry for tensor {key!r} ({err!r})") from None
        if code not in _ST_DTYPES:
            raise CheckpointError(f"cannot read {path}: tensor {key!r} has dtype {code}, which torch cannot hold")
        dtype = _ST_DTYPES[code]
        numel = math.prod(shape)
        if min(shape, default=0) < 0 or not 0 <= b <= e or e - b != numel * dtype.itemsize:
            raise CheckpointError(f"cannot read {path}: tensor {key!r} has inconsistent shape {list(shape)}, "
                                  f"dtype {code} and byte range [{b}, {e})")
        if base + e > size:
            raise CheckpointError(f"cannot read {path}: the file is truncated (tensor {key!r} ends at byte "
                                  f"{base + e}, the file has {size} bytes)")
        entries[key] = TensorEntry(path, key, dtype, shape, base + b, base + e)
    return entries


def safetensors_files(folder: Path) -> dict[str, Path]:
    """Map each tensor key to the safetensors file that holds it."""
    return {k: e.path for k, e in safetensors_entries(folder).items()}


def safetensors_entries(folder: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint in ``folder`` (one file or shards + index), from the file headers."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        missing_files = sorted({f for f in weight_map.values() if not (folder / f).exists()})
        if missing_files:
            raise CheckpointError(f"{index} names shard files that are not in {folder}: {missing_files}")
        headers = {f: read_header(folder / f) for f in sorted(set(weight_map.values()))}
        entries = {}
        for key, f in weight_map.items():
            if key not in headers[f]:
                raise CheckpointError(f"{index} maps tensor {key!r} to {f}, which does not hold it")
            entries[key] = headers[f][key]
        return entries
    if single.exists():
        return read_header(single)
    found = sorted(p.name for p in folder.iterdir())
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder} (found: {found})")


def expected_tensors(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


READERS = ("auto", "chunked", "safe_open")


def load_state_dict(folder: Path, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                    timings: dict | None = None, reader: str | None = None) -> dict[str, torch.Tensor]:
    """Read every tensor ``model`` needs from the checkpoint in ``folder`` onto ``device`` in ``dtype``.

    ``model`` only supplies the expected names and shapes (``named_parameters``; a model on the ``meta`` device
    is enough). Returns {our parameter name: tensor}, each tensor with its own storage (freed on its own
    when the model drops it, e.g. for the fused weight copies of models/fast.py), ready for
    ``model.load_state_dict(state, strict=True, assign=True)``; a tied lm head (no lm head tensor in the files)
    is the embedding tensor itself. Checked first, from the safetensors headers, before any tensor data is
    read: every file is complete, no tensor appears twice under two layouts, none is missing or unexpected,
    every shape matches the model; a CheckpointError names the file and tensors otherwise.

    ``reader``: "chunked" streams the files in large chunks (``stream_tensors``): on CUDA through pinned
    staging buffers (several reads in flight, double-buffered non-blocking copies to the device); "safe_open"
    reads tensor by tensor with safetensors. "auto" (the default, what ``glmasr.load`` uses): chunked on CUDA,
    safe_open on the CPU. Both give bit-identical tensors; casting to ``dtype`` happens on ``device``.

    ``timings``: if a dict is given, it is filled with ``weights_read_ms`` (host time reading file bytes:
    the chunked reads, or the whole safe_open loop), ``weights_to_device_ms`` (chunked: device time of the
    host-to-device copies and casts, summed over chunks from CUDA events read after a synchronize, which
    overlaps ``weights_read_ms``; host time of the copies on the CPU; 0 for safe_open, which reads straight to
    the device), ``weights_total_ms`` (wall time of this call, checks included; on CUDA after a synchronize,
    so every tensor is on the device when it returns) and ``weights_bytes`` (tensor bytes read)."""
    t_start = time.perf_counter()
    reader = reader or "auto"
    if reader not in READERS:
        raise ValueError(f"unknown weights reader {reader!r}: use one of {READERS}")
    if reader == "auto":
        reader = "chunked" if device.type == "cuda" else "safe_open"
    expected = expected_tensors(model)
    entries = safetensors_entries(folder)
    by_name: dict[str, str] = {}
    unexpected = []
    for key in entries:
        name = canonical_name(key)
        if name in _IGNORED:
            continue
        if name is None or name not in expected:
            unexpected.append(key)
        elif name in by_name:
            raise CheckpointError(f"tensor {name!r} appears twice in {folder} (as {by_name[name]!r} and {key!r})")
        else:
            by_name[name] = key
    tied = False
    if "lm_head.weight" not in by_name and "language_model.embed_tokens.weight" in by_name:
        tied = True  # tie_word_embeddings: the lm head shares the embedding matrix
    missing = [n for n in expected if n not in by_name and not (tied and n == "lm_head.weight")]
    if missing or unexpected:
        lines = []
        if missing:
            lines.append(f"missing tensors ({len(missing)}): {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
        if unexpected:
            lines.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected[:20])}"
                         + (" ..." if len(unexpected) > 20 else ""))
        raise CheckpointError(f"checkpoint {folder} does not match the GLM-ASR layout:\n  " + "\n  ".join(lines))
    mis_shaped = [f"{key}: file {entries[key].shape}, model {expected[name]}"
                  for name, key in by_name.items() if entries[key].shape != expected[name]]
    if mis_shaped:
        raise CheckpointError(f"checkpoint {folder} has tensors whose shapes do not match its config.json:\n  "
                              + "\n  ".join(mis_shaped))

    wanted = {name: entries[key] for name, key in by_name.items()}
    stats = {"weights_bytes": sum(e.nbytes for e in wanted.values())}
    if reader == "chunked":
        state = stream_tensors(wanted, device, dtype, stats)
    else:
        state = _read_safe_open(wanted, device, dtype, stats)
    if tied:
        state["lm_head.weight"] = state["language_model.embed_tokens.weight"]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats["weights_total_ms"] = 1e3 * (time.perf_counter() - t_start)
    if timings is not None:
        timings.update(stats)
    return state


def _cuda_index(device: torch.device) -> str:
    return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"


def _read_safe_open(wanted: dict[str, TensorEntry], device: torch.device, dtype: torch.dtype, stats: dict
                    ) -> dict[str, torch.Tensor]:
    """Tensor by tensor with safetensors, straight to ``device``, cast there."""
    from safetensors import safe_open

    t0 = time.perf_counter()
    dev = _cuda_index(device) if device.type == "cuda" else str(device)
    files: dict[Path, list[str]] = {}
    for name, e in wanted.items():
        files.setdefault(e.path, []).append(name)
    state = {}
    for path, names in files.items():
        try:
            with safe_open(str(path), framework="pt", device=dev) as f:
                for name in names:
                    state[name] = f.get_tensor(wanted[name].key).to(dtype)
        except Exception as e:
            raise CheckpointError(f"cannot read tensors from {path}: {e}") from None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats["weights_read_ms"] = 1e3 * (time.perf_counter() - t0)
    stats["weights_to_device_ms"] = 0.0
    return state


# Chunked reader: file bytes -> staging buffer (host) -> device tensors. Measured on the H200 (16 cores), the
# full-size bf16 checkpoint (4.52 GB) in the page cache, two runs: 16 threads 0.20-0.23 s (64 or 256 MiB
# chunks), 8 threads 0.26-0.39 s, 4 threads 0.32-0.39 s, 16 MiB chunks 0.36-0.38 s; safe_open tensor by
# tensor 0.81-1.09 s in the same processes.
CHUNK_BYTES = 64 << 20
STAGING_BUFFERS = 2
READ_THREADS = min(16, os.cpu_count() or 1)
_MIN_READ_PIECE = 4 << 20  # a chunk is split over threads in pieces of at least this size
_MAX_GAP = 1 << 20  # unneeded bytes between two tensors up to this size are read through, not skipped


@dataclass
class _Chunk:
    path: Path
    offset: int  # file offset of the chunk's first byte
    nbytes: int
    # (tensor name, byte offset in the tensor, byte offset in the chunk, length)
    pieces: list = field(default_factory=list)
    finished: list = field(default_factory=list)  # tensors whose last byte is in this chunk


def plan_chunks(wanted: dict[str, TensorEntry], chunk_bytes: int) -> list[_Chunk]:
    """Cover the wanted tensors' bytes, file by file in offset order, with chunks of at most ``chunk_bytes``;
    a tensor larger than a chunk is split over several. Gaps up to _MAX_GAP are read through."""
    chunks: list[_Chunk] = []
    by_file: dict[Path, list[tuple[str, TensorEntry]]] = {}
    for name, e in wanted.items():
        by_file.setdefault(e.path, []).append((name, e))
    for path, items in by_file.items():
        items.sort(key=lambda it: it[1].begin)
        cur: _Chunk | None = None
        for name, e in items:
            pos = e.begin
            if cur is not None and not (0 <= pos - (cur.offset + cur.nbytes) <= _MAX_GAP
                                        and pos + 1 <= cur.offset + chunk_bytes):
                cur = None
            while True:
                if cur is None:
                    cur = _Chunk(path, pos, 0)
                    chunks.append(cur)
                take = min(e.end - pos, cur.offset + chunk_bytes - pos)
                if take > 0:
                    cur.pieces.append((name, pos - e.begin, pos - cur.offset, take))
                cur.nbytes = max(cur.nbytes, pos + take - cur.offset)
                pos += take
                if pos >= e.end:
                    cur.finished.append(name)
                    break
                cur = None
    return chunks


def _read_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill ``view`` from ``fd`` at ``offset`` (pread loop: short reads continue, EOF is an error)."""
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e.strerror or e} at byte {offset + done}") from None
        if n <= 0:
            raise CheckpointError(f"cannot read {path}: the file ends at byte {offset + done}, "
                                  f"{len(view) - done} bytes short of the tensor data (truncated while loading?)")
        done += n


def stream_tensors(wanted: dict[str, TensorEntry], device: torch.device, dtype: torch.dtype | None,
                   stats: dict | None = None, pinned: bool | None = None, chunk_bytes: int | None = None,
                   buffers: int | None = None, threads: int | None = None) -> dict[str, torch.Tensor]:
    """The chunked reader: {name: tensor} for ``wanted`` (entries from ``read_header``), on ``device``, cast to
    ``dtype`` (None: each tensor in its file's dtype).

    Each chunk of file bytes (``plan_chunks``, at most ``chunk_bytes``) is read into one of ``buffers`` staging
    buffers (pinned host memory when ``pinned``, the default on CUDA; plain memory otherwise, which is how the
    CPU tests run this same code), split over ``threads`` concurrent preads; then its pieces are copied into
    the destination tensors (allocated on ``device`` in the file's dtype, each its own storage) with
    non-blocking copies, and every tensor completed by the chunk is cast there. A staging buffer is refilled
    only after the copies out of it have finished (its CUDA event), so reading chunk i+1 overlaps the copies
    of chunk i. Fills ``stats`` with weights_read_ms and weights_to_device_ms (see ``load_state_dict``).
    Defaults: the module's CHUNK_BYTES, STAGING_BUFFERS, READ_THREADS, read when called."""
    from concurrent.futures import ThreadPoolExecutor

    cuda = device.type == "cuda"
    pinned = cuda if pinned is None else pinned
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    buffers = buffers or STAGING_BUFFERS
    threads = threads or READ_THREADS
    stats = {} if stats is None else stats
    chunks = plan_chunks(wanted, chunk_bytes)
    size = max((c.nbytes for c in chunks), default=0)
    staging = [torch.empty(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(min(buffers, len(chunks)))]
    views = [memoryview(b.numpy()) for b in staging]
    done_events: list = [None] * len(staging)
    timing_events = []
    dest: dict[str, torch.Tensor] = {}  # allocated at a tensor's first piece, so that with casts only the
    dest_bytes: dict[str, torch.Tensor] = {}  # tensors in flight exist in the file's dtype as well
    state: dict[str, torch.Tensor] = {}
    read_s = copy_s = 0.0
    fds: dict[Path, int] = {}
    try:
        for c in chunks:
            if c.path not in fds:
                fds[c.path] = os.open(c.path, os.O_RDONLY)
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool, \
                (torch.cuda.device(device) if cuda else contextlib.nullcontext()):
            for i, c in enumerate(chunks):
                slot = i % len(staging)
                if done_events[slot] is not None:
                    done_events[slot].synchronize()  # the copies out of this buffer are done
                t0 = time.perf_counter()
                parts = max(1, min(threads, c.nbytes // _MIN_READ_PIECE))
                step = max(1, -(-c.nbytes // parts))
                fd, view = fds[c.path], views[slot]
                jobs = [pool.submit(_read_into, fd, view[a:min(a + step, c.nbytes)], c.offset + a, c.path)
                        for a in range(0, c.nbytes, step)]
                for j in jobs:
                    j.result()
                t1 = time.perf_counter()
                read_s += t1 - t0
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                buf = staging[slot]
                for name, t_off, c_off, n in c.pieces:
                    if name not in dest:
                        e = wanted[name]
                        dest[name] = torch.empty(e.shape, dtype=e.dtype, device=device)
                        dest_bytes[name] = dest[name].view(-1).view(torch.uint8)
                    dest_bytes[name][t_off:t_off + n].copy_(buf[c_off:c_off + n], non_blocking=cuda)
                for name in c.finished:
                    e = wanted[name]
                    t = dest.pop(name) if name in dest else torch.empty(e.shape, dtype=e.dtype, device=device)
                    dest_bytes.pop(name, None)
                    state[name] = t if dtype is None or t.dtype == dtype else t.to(dtype)
                if cuda:
                    end.record()
                    done_events[slot] = end
                    timing_events.append((start, end))
                else:
                    copy_s += time.perf_counter() - t1
            if cuda:
                torch.cuda.synchronize(device)
                copy_s = sum(a.elapsed_time(b) for a, b in timing_events) / 1e3
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"cannot read {e.filename or 'the checkpoint'}: {e.strerror or e}") from None
    finally:
        for fd in fds.values():
            os.close(fd)
    stats["weights_read_ms"] = 1e3 * read_s
    stats["weights_to_device_ms"] = 1e3 * copy_s
    return state


def read_config(folder: Path) -> GlmAsrConfig:
    path = folder / "config.json"
    if not path.exists():
        raise CheckpointError(f"no config.json in {folder}: not a GLM-ASR checkpoint folder")
    return GlmAsrConfig.from_json_file(path)


def hub_snapshot(repo_id: str, patterns: list[str]) -> Path:
    """The folder of a Hugging Face hub repo's files matching ``patterns``: the cached copy when there is one (no
    network), else a download; raises what ``snapshot_download`` raised (the callers phrase the advice)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    return Path(snapshot_download(repo_id, allow_patterns=patterns))
