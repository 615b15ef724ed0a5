"""`glmasr transcribe FILES_OR_DIRS...`: outputs per file (folder layout kept, same stems never overwriting each
other), corrupt files reported once and skipped, existing outputs kept unless --overwrite, count flags checked at
parse time, the windows fallback without the VAD weights, VAD on the loader threads while the engine decodes,
progress and its time estimate, and Ctrl-C (real processes, real SIGINT)."""

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import soundfile as sf

import glmasr
from glmasr import cli
from glmasr.audio import vad
from glmasr.cli import transcribe as transcribe_cli
from glmasr.checkpoint.tokenizer import DEFAULT_PROMPT, build_instruction
from glmasr.writers import render

from conftest import noise

ARGS = ["--device", "cpu", "--segmentation", "windows", "--max-new-tokens", "4", "-q"]


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    sf.write(d / "a.wav", noise(3.0, 1), 16000, subtype="PCM_16")
    sf.write(d / "b.flac", noise(35.0, 2), 16000)
    sf.write(d / "sub" / "c.wav", noise(2.0, 3), 22050, subtype="PCM_16")
    (d / "broken.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunk" + bytes(range(200)))
    (d / "notes.txt").write_text("not audio, not picked up")
    return d


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _assert_json_of(path: Path, r) -> None:
    """The json output is r's (log-probabilities aside: a batch beside it may move them in the last digits)."""
    got, want = json.loads(path.read_text(encoding="utf-8")), json.loads(render(r, "json"))
    for seg in got["segments"] + want["segments"]:
        seg.pop("avg_logprob")
    assert got == want


def test_folder_with_a_corrupt_file(folder, tmp_path, tiny_shipped, tiny_asr, capsys):
    out = tmp_path / "out"
    rc = cli.main(["transcribe", str(folder), "--model", str(tiny_shipped), "-f", "txt,srt,json", "-o", str(out)]
                  + ARGS)
    err = capsys.readouterr().err
    broken = str(folder / "broken.wav")
    assert rc == 1 and "3 of 4 file(s) transcribed" in err
    assert err.count(broken) == 1, err  # the error names the file once (the message already holds the path)
    assert _files(out) == sorted(f"{s}.{f}" for s in ("a", "b", "sub/c") for f in ("txt", "srt", "json"))
    for stem, path in (("a", folder / "a.wav"), ("b", folder / "b.flac"), ("sub/c", folder / "sub" / "c.wav")):
        r = glmasr.transcribe(str(path), model=tiny_asr, max_new_tokens=4)
        for fmt in ("srt", "txt"):
            assert (out / f"{stem}.{fmt}").read_text(encoding="utf-8") == render(r, fmt)
        _assert_json_of(out / f"{stem}.json", r)

    (out / "a.txt").write_text("kept")
    rc = cli.main(["transcribe", str(folder / "a.wav"), str(folder / "sub"), "--model", str(tiny_shipped),
                   "-f", "txt,srt,json", "-o", str(out)] + ARGS)
    err = capsys.readouterr().err
    # a.wav named itself goes to out/, sub/ searched gives c.wav relative to sub/, so out/c.* (not there yet)
    assert rc == 0 and err.count("skipped") == 1 and (out / "a.txt").read_text() == "kept"
    assert (out / "c.txt").read_text() == (out / "sub" / "c.txt").read_text()
    rc = cli.main(["transcribe", str(folder / "a.wav"), "--model", str(tiny_shipped), "-f", "txt", "-o", str(out),
                   "--overwrite"] + ARGS)
    assert rc == 0 and (out / "a.txt").read_text() != "kept"


def test_outputs_never_overwrite_each_other(tmp_path, tiny_shipped, tiny_asr, capsys):
    """coll/A/x.wav, coll/A/x.flac and coll/B/x.wav into one --output-dir: three outputs, each its own file's,
    and a rerun skips exactly those; two inputs that would still share an output are refused up front."""
    coll = tmp_path / "coll"
    (coll / "A").mkdir(parents=True)
    (coll / "B").mkdir()
    audio = {coll / "A" / "x.wav": noise(2.0, 11), coll / "A" / "x.flac": noise(2.5, 12),
             coll / "B" / "x.wav": noise(3.0, 13)}
    for path, samples in audio.items():
        sf.write(path, samples, 16000, subtype="PCM_16")
    out = tmp_path / "coll_out"
    rc = cli.main(["transcribe", str(coll), "-f", "json", "-o", str(out), "--model", str(tiny_shipped)] + ARGS)
    assert rc == 0 and "3 of 3 file(s) transcribed" in capsys.readouterr().err
    expected = {coll / "A" / "x.wav": "A/x.wav.json", coll / "A" / "x.flac": "A/x.flac.json",
                coll / "B" / "x.wav": "B/x.json"}
    assert _files(out) == sorted(expected.values())
    for path, name in expected.items():
        r = glmasr.transcribe(str(path), model=tiny_asr, max_new_tokens=4)
        _assert_json_of(out / name, r)
    durations = {json.loads((out / n).read_text())["duration"] for n in expected.values()}
    assert len(durations) == 3  # three different files' results

    rc = cli.main(["transcribe", str(coll), "-f", "json", "-o", str(out), "--model", str(tiny_shipped)] + ARGS)
    err = capsys.readouterr().err
    assert rc == 0 and err.count("skipped") == 3 and "transcribed" not in err

    # next to the audio (no --output-dir): the same disambiguation
    rc = cli.main(["transcribe", str(coll / "A"), "-f", "txt", "--model", str(tiny_shipped)] + ARGS)
    assert rc == 0 and {"x.wav.txt", "x.flac.txt"} <= {p.name for p in (coll / "A").iterdir()}

    # two files named x.wav from different folders into one folder: refused before any work, naming both
    other = tmp_path / "other"
    other.mkdir()
    sf.write(other / "x.wav", noise(2.0, 14), 16000, subtype="PCM_16")
    capsys.readouterr()
    rc = cli.main(["transcribe", str(coll / "B" / "x.wav"), str(other / "x.wav"), "-o", str(tmp_path / "o2"),
                   "--model", str(tiny_shipped)] + ARGS)
    err = capsys.readouterr().err
    assert rc == 2 and "output clash" in err and str(coll / "B" / "x.wav") in err and str(other / "x.wav") in err
    assert not (tmp_path / "o2").exists()


def test_outputs_next_to_the_audio_and_all_formats(tmp_path, tiny_shipped):
    sf.write(tmp_path / "x.wav", noise(2.0, 4), 16000, subtype="PCM_16")
    assert cli.main(["transcribe", str(tmp_path / "x.wav"), "--model", str(tiny_shipped), "-f", "all"] + ARGS) == 0
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".srt", ".tsv", ".txt", ".vtt", ".wav"]


def test_bad_arguments(tmp_path, tiny_shipped, capsys):
    with pytest.raises(SystemExit):
        cli.main(["transcribe", str(tmp_path), "-f", "docx"])
    assert "unknown format 'docx'" in capsys.readouterr().err
    rc = cli.main(["transcribe", str(tmp_path / "missing.wav"), "--model", str(tiny_shipped)] + ARGS)
    assert rc == 1 and "no such file or folder" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--max-batch", "0"), ("--max-batch", "-3"), ("--max-new-tokens", "0"),
                                        ("--repetition-stop", "1"), ("--retries", "-1"), ("--file-timeout", "0"),
                                        ("--max-batch", "two")])
def test_count_flags_refused_at_parse_time(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["transcribe", str(tmp_path / "missing.wav"), flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}" in err and value in err, err
    assert "no such file" not in err  # refused before anything else


def test_without_the_vad_weights_one_warning_then_windows(tmp_path, tiny_shipped, tiny_asr, monkeypatch, capsys):
    import importlib.metadata as md

    real = md.distribution

    def distribution(name):
        if name == vad.DISTRIBUTION:
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "distribution", distribution)
    vad._cached_model.cache_clear()  # a network loaded earlier in this process must not hide the missing wheel
    paths = [tmp_path / "p.wav", tmp_path / "q.wav"]
    for k, p in enumerate(paths):
        sf.write(p, noise(2.0 + k, 20 + k), 16000, subtype="PCM_16")
    base = ["--model", str(tiny_shipped), "--device", "cpu", "--max-new-tokens", "4", "-q"]
    rc = cli.main(["transcribe", *map(str, paths), *base])
    err = capsys.readouterr().err
    warnings_ = [line for line in err.splitlines() if line.startswith("warning:")]
    assert rc == 0 and len(warnings_) == 1 and "windows" in warnings_[0] and "silero-vad" in warnings_[0], err
    assert "error" not in err
    for p in paths:
        r = glmasr.transcribe(str(p), model=tiny_asr, max_new_tokens=4, segmentation="windows")
        assert p.with_suffix(".txt").read_text(encoding="utf-8") == render(r, "txt")
        p.with_suffix(".txt").unlink()

    rc = cli.main(["transcribe", *map(str, paths), "--segmentation", "vad", *base])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("error:") == 1 and "silero-vad" in err, err
    assert not any(p.with_suffix(".txt").exists() for p in paths)
    vad._cached_model.cache_clear()


def test_vad_weights_load_without_a_warning(monkeypatch):
    """torch 2.14 and 2.15 (what `pip install torch` gives a new user) mark torch.jit.load deprecated with a
    FutureWarning, which Python shows by default: loading the VAD weights must not print it on every run."""
    import torch

    real = torch.jit.load

    def load(*args, **kwargs):
        warnings.warn("`torch.jit.load` is deprecated. Please switch to `torch.export`.", FutureWarning)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.jit, "load", load)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tensors = vad.load_weights()
    assert not caught, [str(w.message) for w in caught]
    assert tensors["conv1.weight"].shape == (128, 129, 3)


def test_vad_stops_when_cancelled():
    """What lets one Ctrl-C stop loader threads inside a long recording's VAD: ``cancel`` is looked at again and
    again while the recurrence runs, so the call ends early with VadCancelled."""

    class SetFromLook:  # an Event that reads as set from its n-th look on: no timing involved
        def __init__(self, n):
            self.n, self.looks = n, 0

        def is_set(self):
            self.looks += 1
            return self.looks >= self.n

    audio = noise(120.0, 60)  # 3750 windows: one front-end chunk, then the recurrence
    for n in (1, 10):
        cancel = SetFromLook(n)
        with pytest.raises(vad.VadCancelled):
            vad.segment(audio, device="cpu", cancel=cancel)
        assert cancel.looks == n
    # (n = 10 stopped it inside the recurrence: one look per front-end chunk and one before the recurrence, then
    # one every _CANCEL_EVERY steps)
    short = audio[: 5 * 16000]
    assert vad.segment(short, device="cpu", cancel=threading.Event()) == vad.segment(short, device="cpu")


def test_vad_on_the_loader_threads_while_the_engine_decodes(tmp_path, tiny_shipped, tiny_asr, monkeypatch, capsys):
    """The last file's VAD waits until the first file's output exists: it can only end well if VAD runs beside
    the decoding (on the loader threads), not before it. Non-tty stderr gets a line per finished file."""
    n = 8
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    for k in range(n):  # lengths tell the files apart inside segment()
        sf.write(src / f"f{k}.wav", noise(2.0 + 0.25 * k, 30 + k), 16000, subtype="PCM_16")
    first = out / "f0.txt"
    calls = []

    def segment(samples, max_s=30.0, device=None, cancel=None, **kwargs):
        seconds = len(samples) / 16000
        k = round((seconds - 2.0) / 0.25)
        if k == n - 1:
            deadline = time.monotonic() + 20.0
            while not first.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        calls.append((k, threading.current_thread() is threading.main_thread(), first.exists()))
        return [(0.0, min(seconds, max_s))]

    monkeypatch.setattr(vad, "segment", segment)
    rc = cli.main(["transcribe", str(src), "--model", str(tiny_shipped), "-o", str(out), "--device", "cpu",
                   "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert sorted(k for k, _, _ in calls) == list(range(n))
    assert not any(in_main for _, in_main, _ in calls)
    assert next(seen for k, _, seen in calls if k == n - 1), "the first output was not written before the last VAD"
    lines = err.splitlines()
    assert lines[0].startswith(f"transcribing {n} file(s)")
    done = [line for line in lines if line.startswith("[")]
    assert [line.split("]")[0] for line in done] == [f"[{k}/{n}" for k in range(1, n + 1)]
    assert all("of audio" in line and "elapsed" in line for line in done)
    for k in (0, n - 1):  # the pieces computed on the loader threads give what plan_audio gives
        r = glmasr.transcribe(str(src / f"f{k}.wav"), model=tiny_asr, max_new_tokens=4, segmentation="vad")
        assert (out / f"f{k}.txt").read_text(encoding="utf-8") == render(r, "txt")


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_time_left_only_once_it_can_be_estimated():
    clock, stream = _Clock(), io.StringIO()
    one = transcribe_cli._Progress([21.0], quiet=False, stream=stream, clock=clock)  # one 21 s file
    one.begin("loading the model")
    clock.now += 3.0
    one.working("reading")
    clock.now += 0.5
    assert one.eta() is None
    one.partial(0, 0.05)
    assert one.eta() is None
    clock.now += 10.0
    one.done(0, 21.0, Path("a.wav"))
    assert one.eta() is None and "left" not in stream.getvalue()

    ten = transcribe_cli._Progress([60.0] * 10, quiet=False, stream=io.StringIO(), clock=clock)
    ten.working("reading")
    clock.now += 5.0
    ten.partial(0, 0.25)
    ten.partial(1, 0.25)
    assert ten.eta() is None  # 5 % done: mostly start-up so far
    clock.now += 5.0
    ten.done(0, 60.0, Path("0.wav"))
    ten.partial(1, 1.0)
    assert ten.eta() == pytest.approx(10.0 * 0.8 / 0.2)  # 20 % in 10 s
    unknown = transcribe_cli._Progress([60.0, 0.0], quiet=False, stream=io.StringIO(), clock=clock)
    unknown.working("reading")
    clock.now += 5.0
    unknown.done(0, 60.0, Path("0.wav"))
    assert unknown.eta() is None  # the second file's length is not known yet


def test_status_line_on_a_terminal_from_the_start():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    showwarning = warnings.showwarning
    p = transcribe_cli._Progress([30.0, 30.0], quiet=False, stream=stream)
    p.begin("loading the model")
    assert "\r" in stream.getvalue() and "loading the model" in stream.getvalue() and "0/2 files" in stream.getvalue()
    p.message("error: x.wav: broken")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("y.wav: truncated audio file", glmasr.AudioWarning)  # e.g. from a loader thread
    p.close()
    text = stream.getvalue()
    assert "error: x.wav: broken\n" in text and text.endswith("\r")  # the status line is cleared at the end
    assert "AudioWarning: y.wav: truncated audio file\n" in text and warnings.showwarning is showwarning


# ---- Ctrl-C, in real processes ----
_CHILD = r"""
import os, signal, sys, time

# as in a terminal: a job a shell started in the background inherits SIGINT ignored, and Python then keeps it so
signal.signal(signal.SIGINT, signal.default_int_handler)
import glmasr.audio.vad as vad

real = vad.segment
mode = os.environ["GLMASR_TEST_MODE"]


def segment(samples, max_s=30.0, cancel=None, **kwargs):
    seconds = len(samples) / 16000
    sys.stdout.write(f"VAD {seconds:.1f}\n")  # one write: lines of two threads do not interleave
    sys.stdout.flush()
    if mode == "real":
        return real(samples, max_s=max_s, **kwargs, **({} if cancel is None else {"cancel": cancel}))
    if seconds > 2.5:  # the later files: a VAD that never looks at cancel (only a second Ctrl-C ends it)
        time.sleep(60)
    return [(0.0, min(seconds, max_s))]


vad.segment = segment
from glmasr import cli

sys.exit(cli.main(sys.argv[1:]))
"""


class _Child:
    """``python -c _CHILD ARGS`` with its stdout and stderr lines collected as they come."""

    def __init__(self, args, mode):
        env = {**os.environ, "GLMASR_TEST_MODE": mode, "PYTHONUNBUFFERED": "1"}
        self.p = subprocess.Popen([sys.executable, "-c", _CHILD, *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=self._read, args=(s, lines), daemon=True)
                        for s, lines in ((self.p.stdout, self.out), (self.p.stderr, self.err))]
        for t in self.readers:
            t.start()

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait_for(self, what, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            if self.p.poll() is not None or time.monotonic() > deadline:
                self.p.kill()
                raise AssertionError(f"gave up waiting (exit {self.p.poll()}):\n" + "\n".join(self.err))
            time.sleep(0.02)

    def exit_within(self, timeout: float) -> int:
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise AssertionError(f"still running {timeout} s after Ctrl-C:\n" + "\n".join(self.err)) from None
        for t in self.readers:
            t.join(5.0)
        return rc

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()


def _check_clean_stderr(err: list[str]) -> None:
    text = "\n".join(err)
    assert "Traceback" not in text and "terminate called" not in text, text
    assert sum(line.startswith("interrupted:") for line in err) == 1, text


def test_ctrl_c_during_vad_stops_at_once(tmp_path, tiny_shipped):
    """Two 10-minute recordings (1-100 s of VAD each on a CPU, with the load): one Ctrl-C as their VAD starts stops
    the loader threads at their next cancel check; the process ends with 130, one line, no traceback (the old
    code: a traceback, or an abort from a thread left inside torch, exit 134)."""
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    for k in range(2):
        sf.write(src / f"long{k}.wav", noise(600.0, 40 + k), 16000, subtype="PCM_16")
    child = _Child(["transcribe", str(src), "--model", str(tiny_shipped), "-o", str(out), "--device", "cpu",
                    "--max-new-tokens", "4"], mode="real")
    try:
        child.wait_for(lambda: any("VAD" in line for line in child.out), timeout=60.0)
        child.p.send_signal(signal.SIGINT)
        t = time.monotonic()
        rc = child.exit_within(30.0)
        assert rc == 130 and time.monotonic() - t < 12.0, (rc, time.monotonic() - t, child.err)
    finally:
        child.kill()
    _check_clean_stderr(child.err)
    done = int(child.err[-1].split("interrupted: ")[1].split(" of 2 ")[0])
    assert done < 2 and len(_files(out) if out.exists() else []) == done  # whole outputs of finished files only


def test_ctrl_c_after_the_first_outputs_then_again(tmp_path, tiny_shipped):
    """The first Ctrl-C after two files are written: it says so at once and stops (the outputs written stay, whole;
    nothing is left half-written); the run is stuck in a VAD that cannot be cancelled, so a second Ctrl-C ends
    the process at once with 130."""
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    for k, seconds in enumerate((2.0, 2.0, 3.0, 3.0)):
        sf.write(src / f"f{k}.wav", noise(seconds, 50 + k), 16000, subtype="PCM_16")
    child = _Child(["transcribe", str(src), "--model", str(tiny_shipped), "-o", str(out), "--device", "cpu",
                    "--max-new-tokens", "4", "-f", "json,srt"], mode="stuck")
    try:
        child.wait_for(lambda: all((out / f"f{k}.{f}").exists() for k in (0, 1) for f in ("json", "srt"))
                       and "".join(child.out).count("VAD 3.0") == 2)
        child.p.send_signal(signal.SIGINT)
        child.wait_for(lambda: any(line.startswith("interrupted:") for line in child.err), timeout=10.0)
        assert child.p.poll() is None  # waiting for the stuck loader thread
        child.p.send_signal(signal.SIGINT)
        t = time.monotonic()
        rc = child.exit_within(10.0)
        assert rc == 130 and time.monotonic() - t < 5.0
    finally:
        child.kill()
    _check_clean_stderr(child.err)
    assert "2 of 4 file(s) transcribed" in next(line for line in child.err if line.startswith("interrupted:"))
    assert _files(out) == ["f0.json", "f0.srt", "f1.json", "f1.srt"]  # no temporary or partial files
    for k in (0, 1):
        assert json.loads((out / f"f{k}.json").read_text())["duration"] == pytest.approx(2.0)


def test_hotwords_in_the_instruction():
    assert build_instruction(None, []) is None and build_instruction("Say it", []) == "Say it"
    assert build_instruction(None, [" GLM ", "Zhipu"]) == f"{DEFAULT_PROMPT}\nHotwords: GLM, Zhipu"
    with pytest.raises(ValueError, match="hotwords"):
        build_instruction("x", ["ok", " "])


def test_sigint_guard_check_acts_on_a_lost_interrupt():
    """A Ctrl-C whose KeyboardInterrupt was swallowed (it landed in a finalizer or a callback) is still acted on:
    the run's loop calls ``check`` at every wake-up; inside ``deferred`` it waits for the block's end."""
    from glmasr.cli.transcribe import _SigintGuard

    guard = _SigintGuard()
    guard.check()  # nothing pending
    guard.requested = True  # the handler ran, its raise was lost
    with pytest.raises(KeyboardInterrupt):
        guard.check()
    reached = False
    with pytest.raises(KeyboardInterrupt):
        with guard.deferred():
            guard.check()  # deferred: not here
            reached = True
    assert reached
