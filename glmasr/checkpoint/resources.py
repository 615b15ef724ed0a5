"""Where the package finds its data files and its caches.

The shipped data lives in the top-level ``configs/`` and ``assets/`` folders of the source tree. A wheel carries
them inside the package (``glmasr/configs/``, ``glmasr/assets/``: pyproject.toml maps the two folders in as
package data), so an installed copy finds them through ``importlib.resources``; a source checkout (an editable
install, or the checkout on ``PYTHONPATH`` as on the GPU machine) has them next to the package folder instead.

Caches go to a user-writable folder, never into the package or the source tree: ``cache_dir()`` is
``$GLMASR_CACHE_DIR``, else ``$XDG_CACHE_HOME/glmasr``, else ``~/.cache/glmasr``; the tiny random checkpoint of
``--model tiny-random`` lives in its ``tiny-random`` subfolder (the log-mel cubins: ``glmasr_kernels.logmel._build``).
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

SAMPLE_AUDIO = "speech_en.flac"
REAL_WEIGHTS_NAME = "GLM-ASR-Nano-2512"


def cache_dir() -> Path:
    """User-writable cache root: $GLMASR_CACHE_DIR, else $XDG_CACHE_HOME/glmasr, else ~/.cache/glmasr."""
    env = os.environ.get("GLMASR_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "glmasr"


def _package_dir() -> Path:
    """The ``glmasr`` package's folder (the data ships inside it: glmasr/configs, glmasr/assets)."""
    return Path(str(importlib.resources.files("glmasr")))


def checkout_root() -> Path | None:
    """The source checkout the package is imported from (editable install, PYTHONPATH), or None (wheel)."""
    root = _package_dir().parent
    return root if (root / "pyproject.toml").is_file() and (root / "configs").is_dir() else None


def data_dir(name: str) -> Path:
    """Folder of shipped data ``name`` ("configs" or "assets"): inside the installed package, else in the checkout."""
    inside = _package_dir() / name
    if inside.is_dir():
        return inside
    root = checkout_root()
    if root is not None and (root / name).is_dir():
        return root / name
    raise FileNotFoundError(
        f"glmasr data folder {name!r} not found: neither {inside} (installed package) nor a source checkout "
        f"next to {_package_dir()}; reinstall glmasr (pip install glmasr / pip install -e <checkout>)"
    )


def config_file(name: str) -> Path:
    """A shipped model config by name: ``tiny-random`` or ``glm-asr-nano-2512``."""
    path = data_dir("configs") / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in data_dir("configs").glob("*.json"))
        raise FileNotFoundError(f"no shipped config {name!r} (have {known})")
    return path


def sample_audio() -> Path:
    """The short speech sample the demo transcribes when given no audio."""
    return data_dir("assets") / SAMPLE_AUDIO


def local_weights_candidates() -> list[Path]:
    """Where a local copy of the real weights is looked for, in order: ``weights/GLM-ASR-Nano-2512`` next to the
    source checkout (when running from one), then ``./weights/GLM-ASR-Nano-2512`` under the working directory."""
    out = []
    root = checkout_root()
    if root is not None:
        out.append(root / "weights" / REAL_WEIGHTS_NAME)
    cwd = Path.cwd() / "weights" / REAL_WEIGHTS_NAME
    if all(cwd.resolve() != p.resolve() for p in out):
        out.append(cwd)
    return out


__all__ = ["checkout_root", "data_dir", "config_file", "sample_audio", "cache_dir", "local_weights_candidates"]
