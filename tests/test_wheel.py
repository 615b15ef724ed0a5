"""The wheel: build it from a copy of the checkout, check what it carries, install it with ``pip --target`` into a
folder away from the checkout and run the demo from it (``--model tiny-random`` on the shipped sample), in a child
that can only see the installed copy.

Built without build isolation when this environment has the backend (the ``test`` extra brings setuptools), so
no download is needed; otherwise pip builds it in an isolated environment (needs PyPI, as CI has).
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Not part of the source a wheel is built from (big, or build outputs of other runs).
_SKIP_TOP = {".git", "weights", ".whl", "build", "dist", "out", "bench_out", ".venv", "shared", "notes"}
_SKIP_ANY = {"__pycache__", ".pytest_cache"}


def _have_backend() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    major = int(setuptools.__version__.split(".")[0])
    return major >= 77  # pyproject.toml's build-system requirement


def _copy_source(dst: Path) -> Path:
    def ignore(folder, names):
        top = Path(folder).resolve() == REPO
        return {n for n in names if n in _SKIP_ANY or n.endswith(".egg-info") or (top and n in _SKIP_TOP)}

    shutil.copytree(REPO, dst, ignore=ignore, symlinks=True)
    return dst


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built once per module, from a copy of the checkout (a build in the checkout writes build/ and *.egg-info
    there, races with other runs, and may pack stale files from an old build/)."""
    base = tmp_path_factory.mktemp("wheel")
    src = _copy_source(base / "src")
    out = base / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check", "-w", str(out),
           str(src)]
    if _have_backend():
        cmd.insert(4, "--no-build-isolation")
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=base, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}"
    wheels = list(out.glob("glmasr-*.whl"))
    assert len(wheels) == 1, wheels
    print(f"wheel built in {time.perf_counter() - t:.1f} s: {wheels[0].name}")
    return wheels[0]


def test_wheel_contents(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        meta = email.parser.Parser().parsestr(z.read(f"{dist_info}/METADATA").decode())
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
        license_text = z.read(f"{dist_info}/licenses/LICENSE")

    configs = {f"glmasr/configs/{p.name}" for p in (REPO / "configs").glob("*.json")}
    assert {"glmasr/configs/tiny-random.json", "glmasr/configs/glm-asr-nano-2512.json"} <= configs <= names
    assert "glmasr/assets/speech_en.flac" in names
    assert "glmasr/checkpoint/resources.py" in names and "glmasr/cli/main.py" in names
    # the live room, the Realtime endpoint and the microphone page (package data) are in the wheel
    assert {"glmasr/live/session.py", "glmasr/server/realtime/routes.py", "glmasr/server/static/index.html",
            "glmasr/server/static/app.js"} <= names
    assert {"glmasr_kernels/__init__.py", "glmasr_kernels/logmel/__init__.py", "glmasr_kernels/logmel/logmel.cu",
            "glmasr_kernels/logmel/mel_filters.py", "glmasr_kernels/cuda_gemv.cu", "glmasr_kernels/aot.py",
            "glmasr_kernels/manifests/sm90.json", "glmasr/cli/compile.py"} <= names
    cu = {f"glmasr_kernels/logmel/{p.name}" for p in (REPO / "kernels" / "logmel").glob("*.cu*")}
    assert cu <= names, cu - names
    tops = {n.split("/")[0] for n in names if "/" in n and not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"glmasr", "glmasr_kernels"}, f"unexpected top-level folders in the wheel: {tops}"
    assert not any(n.startswith(("kernels/", "configs/", "assets/", "tests/", "scripts/")) for n in names)

    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert license_text == (REPO / "LICENSE").read_bytes()
    assert b"Apache License" in license_text and b"Version 2.0, January 2004" in license_text
    assert "glmasr = glmasr.cli:main" in entry_points


def test_installed_wheel_runs_the_demo_offline(wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q",
                        "--disable-pip-version-check", "--target", str(target), str(wheel)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (target / "bin" / "glmasr").is_file()  # the console entry point

    # The child: python -S (no site-packages processing, so no .pth file, hence no editable finder of this
    # environment) with the installed copy first on the path and the rest of this process's path (torch,
    # transformers, ...) after it, run from an unrelated working directory, the cache in a fresh HOME.
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    rest = [p for p in sys.path if p and Path(p).is_dir() and Path(p).resolve() != REPO]
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "GLMASR_CACHE_DIR", "XDG_CACHE_HOME", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PYTHONPATH=os.pathsep.join([str(target), *rest]), HOME=str(home), HF_HUB_OFFLINE="1",
               GLMASR_WHEEL_TARGET=str(target))
    code = textwrap.dedent("""
        import os, sys
        target = os.path.realpath(os.environ["GLMASR_WHEEL_TARGET"]) + os.sep
        import glmasr, glmasr_kernels, glmasr.cli
        from glmasr.checkpoint import resources
        mods = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())
                if n.split(".")[0] in ("glmasr", "glmasr_kernels")}
        outside = {n: f for n, f in mods.items() if f and not os.path.realpath(f).startswith(target)}
        assert not outside, f"imported from outside the installed wheel: {outside}"
        assert os.path.realpath(glmasr.__file__).startswith(target), glmasr.__file__
        assert os.path.realpath(glmasr_kernels.__file__).startswith(target), glmasr_kernels.__file__
        assert resources.checkout_root() is None
        assert str(resources.sample_audio()).startswith(target), resources.sample_audio()
        print("SAMPLE", resources.sample_audio())
        sys.stdout.flush()
        sys.exit(glmasr.cli.main(["--model", "tiny-random", "--device", "cpu", "--max-new-tokens", "4"]))
    """)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=work, env=env, capture_output=True, text=True,
                       timeout=300)
    print(f"installed demo ran in {time.perf_counter() - t:.1f} s")
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    sample = next(line.split(" ", 1)[1] for line in r.stdout.splitlines() if line.startswith("SAMPLE "))
    assert Path(sample) == target / "glmasr" / "assets" / "speech_en.flac"
    assert any(line.startswith(f"{sample}: ") for line in r.stdout.splitlines()), r.stdout
    assert "finish_reason=length" in r.stderr and "4 text tokens" in r.stderr, r.stderr
    # the tiny checkpoint went to the user cache (~/.cache/glmasr/tiny-random), not into the installed package
    assert (home / ".cache" / "glmasr" / "tiny-random" / "model.safetensors").is_file()
    assert not (target / "weights").exists() and not (target / "glmasr" / "weights").exists()
    assert not any(p.name == "model.safetensors" for p in target.rglob("*"))


def test_every_package_is_listed_in_pyproject():
    """pyproject.toml lists the packages by hand: a new room left out installs a wheel whose ``import glmasr``
    fails. Every folder of glmasr/ with an __init__.py (and each data folder) must be listed."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "glmasr").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
