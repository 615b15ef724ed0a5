"""Where the package finds its data (configs, sample audio), its caches and local weights, from a source checkout:
imported in place (an editable install, or the checkout on PYTHONPATH as on the GPU machine); the name
``tiny-random`` in every entry point; what ``glmasr --help``, ``glmasr serve`` without its extra and the offline
hint tell a new user. The installed wheel is tests/test_wheel.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import glmasr
from glmasr import cli
from glmasr.checkpoint import random_weights as random_checkpoint, resources
from glmasr.cli import common
from glmasr.checkpoint.weights import CheckpointError, resolve_checkpoint

from conftest import noise

REPO = Path(__file__).resolve().parent.parent
FROM_CHECKOUT = Path(glmasr.__file__).resolve().parent.parent == REPO


@pytest.mark.skipif(not FROM_CHECKOUT, reason="glmasr is not imported from this checkout")
def test_data_from_the_checkout():
    assert resources.checkout_root() == REPO
    assert resources.data_dir("configs") == REPO / "configs"
    assert resources.config_file("tiny-random") == REPO / "configs" / "tiny-random.json"
    assert random_checkpoint.config_path("glm-asr-nano-2512") == REPO / "configs" / "glm-asr-nano-2512.json"
    assert resources.sample_audio() == REPO / "assets" / "speech_en.flac" and resources.sample_audio().is_file()
    with pytest.raises(FileNotFoundError, match="no shipped config 'nope'"):
        resources.config_file("nope")
    with pytest.raises(FileNotFoundError, match="not found"):
        resources.data_dir("no-such-folder")


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("GLMASR_CACHE_DIR", str(tmp_path / "c"))
    assert resources.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("GLMASR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resources.cache_dir() == tmp_path / "xdg" / "glmasr"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resources.cache_dir() == tmp_path / "home" / ".cache" / "glmasr"


def test_local_weights_next_to_the_checkout_then_in_the_working_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cands = resources.local_weights_candidates()
    assert cands[-1] == tmp_path / "weights" / "GLM-ASR-Nano-2512"
    if FROM_CHECKOUT:
        assert cands[0] == REPO / "weights" / "GLM-ASR-Nano-2512"
    if any((c / "config.json").exists() for c in cands[:-1]):
        pytest.skip("real weights next to the checkout take precedence")
    from glmasr.checkpoint.weights import DEFAULT_MODEL_ID

    assert common.pick_model(None) == DEFAULT_MODEL_ID
    local = tmp_path / "weights" / "GLM-ASR-Nano-2512"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    assert Path(common.pick_model(None)) == local
    assert common.pick_model("some/hub-id") == "some/hub-id"


def test_tiny_random_is_built_into_the_cache_once(monkeypatch, tmp_path):
    monkeypatch.setenv("GLMASR_CACHE_DIR", str(tmp_path / "cache"))
    builds = []
    real_build = random_checkpoint.build_checkpoint

    def counting_build(folder, *args, **kwargs):
        builds.append(Path(folder))
        return real_build(folder, *args, **kwargs)

    monkeypatch.setattr(random_checkpoint, "build_checkpoint", counting_build)
    folder = resolve_checkpoint("tiny-random")  # where every entry point resolves a model (glmasr.load too)
    assert folder == tmp_path / "cache" / "tiny-random"
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert len(builds) == 1 and builds[0] != folder  # built aside, then renamed into place
    assert sorted(p.name for p in folder.parent.iterdir()) == ["tiny-random"]  # no leftovers

    assert Path(common.pick_model("tiny-random")) == folder and len(builds) == 1  # reused

    stamp = folder / "glmasr-random-checkpoint.json"
    stale = json.loads(stamp.read_text())
    stale["config_sha256"] = "0" * 64
    stamp.write_text(json.dumps(stale))
    assert Path(common.pick_model("tiny-random")) == folder and len(builds) == 2  # stale: rebuilt
    assert json.loads(stamp.read_text())["config_sha256"] != "0" * 64
    asr = glmasr.load("tiny-random", device="cpu")  # the Python API takes the name the CLI takes
    assert asr.folder == folder and len(builds) == 2
    r = glmasr.transcribe(noise(1.5, 7), model=asr, sampling_rate=16000, max_new_tokens=3)
    assert isinstance(r, glmasr.Transcription) and 1 <= len(r.token_ids) <= 3
    asr.close()


def test_tiny_random_cache_not_writable(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("GLMASR_CACHE_DIR", str(blocker / "sub"))  # a folder under a file: cannot be created
    with pytest.raises(CheckpointError, match="GLMASR_CACHE_DIR"):
        common.pick_model("tiny-random")
    with pytest.raises(CheckpointError, match="GLMASR_CACHE_DIR"):
        glmasr.load("tiny-random", device="cpu")


def test_offline_hint_names_commands_that_exist(hub_offline):
    """Current huggingface_hub installs `hf`, not `huggingface-cli`; a wheel user has `glmasr`, not demo.py."""
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint("someone/not-cached-model")
    text = str(e.value)
    assert "hf download someone/not-cached-model --local-dir" in text
    assert "glmasr --model /path/to/GLM-ASR-Nano-2512" in text and "glmasr --model tiny-random" in text
    assert "huggingface-cli" not in text and "demo.py" not in text


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "glmasr transcribe FILES_OR_DIRS" in out and "glmasr serve" in out and "pip install 'glmasr[serve]'" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["--max-new-tokens", "0"])
    assert e.value.code == 2 and "--max-new-tokens: must be at least 1" in capsys.readouterr().err


def test_serve_without_the_serve_extra(monkeypatch, capsys):
    """`glmasr serve --help` where fastapi and uvicorn are not installed: the extra to install, no traceback."""
    for name in ("fastapi", "uvicorn"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it fails as if it were not installed
    for name in [n for n in sys.modules if n == "glmasr.server" or n.startswith("glmasr.server.")]:
        monkeypatch.delitem(sys.modules, name)  # imported afresh, without them
    assert cli.main(["serve", "--help"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'glmasr[serve]'" in err and "fastapi" in err and "Traceback" not in err


@pytest.mark.skipif(not FROM_CHECKOUT, reason="glmasr is not imported from this checkout")
def test_checkout_on_pythonpath_only(tmp_path):
    """The GPU machine's set-up (scripts/device_env.sh): nothing installed, PYTHONPATH = a folder holding a
    glmasr_kernels link to kernels/, then the checkout; run from elsewhere, without site processing (so no
    editable finder of this environment)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "glmasr_kernels").symlink_to(REPO / "kernels", target_is_directory=True)
    rest = [p for p in sys.path if p and Path(p).is_dir() and Path(p).resolve() != REPO]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), *rest])
    code = textwrap.dedent(f"""
        import os, glmasr, glmasr_kernels.logmel.mel_filters as mf
        from glmasr.checkpoint import resources
        from glmasr.checkpoint.random_weights import config_path
        repo = {str(REPO)!r}
        assert os.path.dirname(os.path.dirname(glmasr.__file__)) == repo, glmasr.__file__
        assert os.path.realpath(mf.__file__).startswith(os.path.join(repo, "kernels") + os.sep), mf.__file__
        assert str(resources.data_dir("configs")) == os.path.join(repo, "configs")
        assert str(config_path("tiny-random")) == os.path.join(repo, "configs", "tiny-random.json")
        assert resources.sample_audio().is_file()
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
