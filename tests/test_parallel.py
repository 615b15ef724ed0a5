"""glmasr.workers: one engine process per device (two CPU workers here), files handed out as workers have room,
results identical to one process, a crashed worker's files retried elsewhere, a file that kills every worker
reported failed. Every wait is bounded (``_bounded``)."""

from __future__ import annotations


import pytest
import torch
import soundfile as sf

import glmasr
from glmasr import cli
from glmasr.workers import DevicePool, WorkerStartError, parse_devices, transcribe_files

from conftest import bounded, noise

TOKENS = 4
LIMIT_S = 120  # any one test's pool work; a hang fails the test instead of the suite


def _bounded(fn, timeout=LIMIT_S):
    return bounded(fn, timeout)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("parallel")
    paths = []
    for i, (name, seconds, rate) in enumerate([("a.wav", 2.0, 16000), ("b.flac", 35.0, 16000),
                                               ("c.wav", 1.5, 22050), ("d.wav", 3.0, 16000),
                                               ("e.wav", 2.5, 8000), ("f.wav", 1.2, 16000)]):
        p = d / name
        sf.write(p, noise(seconds, 40 + i, rate), rate, **({"subtype": "PCM_16"} if name.endswith("wav") else {}))
        paths.append(p)
    return d, paths


@pytest.fixture(scope="module")
def reference(tiny_shipped, files):
    """What one process gives for each file."""
    asr = glmasr.load(tiny_shipped, device="cpu")
    out = {str(p): glmasr.transcribe(str(p), model=asr, max_new_tokens=TOKENS) for p in files[1]}
    asr.close()
    return out


def _same(a, b):
    """Tokens, text and times exactly; float scores (a segment's avg_logprob) to fp32 rounding: the worker's
    thread count and the files batched beside this one change the last bits of the logits, never a token."""
    assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
    assert a.duration_s == b.duration_s and a.num_windows == b.num_windows
    assert [(s.start, s.end, s.text, s.token_ids, s.finish_reason) for s in a.segments] == \
        [(s.start, s.end, s.text, s.token_ids, s.finish_reason) for s in b.segments]
    for x, y in zip(a.segments, b.segments):
        assert x.compression_ratio == y.compression_ratio
        assert getattr(x, "avg_logprob", 0.0) == pytest.approx(getattr(y, "avg_logprob", 0.0), rel=1e-5, abs=1e-6)


def _same_json(text, r):
    import json

    from glmasr.writers import render

    got, want = json.loads(text), json.loads(render(r, "json"))
    for g, w in zip(got["segments"], want["segments"]):
        assert g.pop("avg_logprob", 0.0) == pytest.approx(w.pop("avg_logprob", 0.0), rel=1e-5, abs=1e-6)
    assert got == want


def test_two_cpu_workers_equal_one_process(tiny_shipped, files, reference, tmp_path):
    _, paths = files
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunk" + bytes(range(100)))
    inputs = [paths[0], broken, *paths[1:], tmp_path / "missing.wav"]
    seen = []
    out = _bounded(lambda: transcribe_files(inputs, devices="cpu,cpu", model=tiny_shipped, max_new_tokens=TOKENS,
                                            in_flight=2, on_result=seen.append))
    assert [r.index for r in out] == list(range(len(inputs))) and [r.path for r in out] == [str(p) for p in inputs]
    assert sorted(r.index for r in seen) == list(range(len(inputs)))  # each streamed back exactly once
    assert not out[1].ok and "broken.wav" in out[1].error and out[1].attempts == 1  # no retry: not a crash
    assert not out[-1].ok and "not found" in out[-1].error
    for r in out[:1] + out[2:-1]:
        assert r.ok and r.device == "cpu" and r.attempts == 1, r
        _same(r.result, reference[r.path])


def test_workers_split_the_cores_and_a_slow_file_holds_only_its_worker(tiny_shipped, files):
    _, paths = files
    with DevicePool(["cpu", "cpu"], model=tiny_shipped, decode=glmasr.DecodeOptions(max_new_tokens=TOKENS),
                    in_flight=1, _test_hooks={"sleep_on": ("a.wav", 4.0)}) as pool:
        workers = _bounded(lambda: pool.wait_ready(timeout=LIMIT_S))
        assert [w["state"] for w in workers] == ["ready", "ready"]
        import os

        cores = len(os.sched_getaffinity(0))
        assert all(w["threads"] == max(1, cores // 2) for w in workers)
        out = _bounded(lambda: list(pool.run(paths)))
        slow = next(r for r in out if r.path.endswith("a.wav"))
        others = [r for r in out if r is not slow]
        # a.wav sleeps 4 s in its worker; the other worker takes the other files meanwhile (static shards would
        # have left half of them queued behind it; one may still reach the slow worker on a loaded machine)
        assert all(r.ok for r in out)
        elsewhere = [i for i, r in enumerate(out) if r.worker != slow.worker]
        assert len(elsewhere) >= len(others) - 1 and max(elsewhere) < out.index(slow)  # completion order
        again = _bounded(lambda: list(pool.run(paths[1:3])))  # the pool is reusable
        assert sorted(r.index for r in again) == [0, 1] and all(r.ok for r in again)


def test_crashed_worker_files_are_retried_and_a_killer_file_is_reported(tiny_shipped, files, reference,
                                                                           tmp_path):
    import shutil

    _, paths = files
    poison = tmp_path / "poison.wav"
    shutil.copy(paths[0], poison)
    inputs = [paths[0], poison, paths[2], paths[3], paths[4], paths[5]]
    with DevicePool("cpu,cpu", model=tiny_shipped, decode=glmasr.DecodeOptions(max_new_tokens=TOKENS),
                    in_flight=2, retries=1, _test_hooks={"crash_on": "poison"}) as pool:
        _bounded(lambda: pool.wait_ready(timeout=LIMIT_S))
        out = sorted(_bounded(lambda: list(pool.run(inputs))), key=lambda r: r.index)
        assert len(out) == len(inputs)
        bad = out[1]
        assert not bad.ok and bad.attempts == 2 and "died each of the 2 times" in bad.error
        assert "exit status 70" in bad.error
        for r in out[:1] + out[2:]:
            assert r.ok, r
            _same(r.result, reference[r.path])
        # the first pass handed out files 0-3 at once: file 3 was in the poisoned worker with it, and was
        # retried alone on a worker that held nothing else
        assert out[3].attempts == 2
        workers = _bounded(lambda: pool.wait_ready(timeout=LIMIT_S))  # the dead workers were restarted
        assert [w["state"] for w in workers] == ["ready", "ready"]


def test_file_timeout_kills_the_worker_and_the_file_fails(tiny_shipped, files):
    _, paths = files
    out = _bounded(lambda: transcribe_files(paths[:2], devices=["cpu"], model=tiny_shipped, max_new_tokens=TOKENS,
                                            retries=0, file_timeout_s=2.0, in_flight=1,
                                            _test_hooks={"sleep_on": ("a.wav", 60.0)}))
    assert not out[0].ok and "took over 2 s" in out[0].error
    assert out[1].ok  # on the restarted worker


def test_no_worker_can_load_the_model(tmp_path, tiny_shipped):
    import shutil

    broken = tmp_path / "ckpt"  # config and tokenizer, no weights: the parent's checks pass, every load fails
    shutil.copytree(tiny_shipped, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    with DevicePool("cpu,cpu", model=broken) as pool:
        with pytest.raises(WorkerStartError, match="no worker could load the model"):
            _bounded(lambda: list(pool.run([tmp_path / "x.wav"])))


def test_bad_devices():
    for bad, msg in (("", "empty"), ("tpu", "unknown device|unsupported device"), ("cpu,gpu:0", "device")):
        with pytest.raises(ValueError, match=msg):
            parse_devices(bad)
    assert parse_devices("cpu, cpu") == ["cpu", "cpu"]
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            parse_devices("cuda:0,cuda:1")


def test_cli_devices(tiny_shipped, files, reference, tmp_path, capsys):
    d, _ = files
    (tmp_path / "in").mkdir()
    import shutil

    for p in sorted(d.iterdir())[:3]:
        shutil.copy(p, tmp_path / "in" / p.name)
    (tmp_path / "in" / "broken.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunk")
    out = tmp_path / "out"
    args = ["transcribe", str(tmp_path / "in"), "--model", str(tiny_shipped), "--devices", "cpu,cpu", "-f",
            "txt,json", "-o", str(out), "--segmentation", "windows", "--max-new-tokens", str(TOKENS), "-q"]
    rc = _bounded(lambda: cli.main(args))
    err = capsys.readouterr().err
    assert rc == 1 and "broken.wav" in err and "3 of 4 file(s) transcribed" in err
    from glmasr.writers import render

    for p in sorted(d.iterdir())[:3]:
        r = reference[str(p)]
        assert (out / f"{p.stem}.txt").read_text() == render(r, "txt")
        _same_json((out / f"{p.stem}.json").read_text(), r)
    rc = cli.main(["transcribe", str(tmp_path / "in"), "--devices", "cpu", "--device", "cpu", "--overwrite",
                   "--model", str(tiny_shipped)])
    assert rc == 2 and "not both" in capsys.readouterr().err
    rc = cli.main(["transcribe", str(tmp_path / "in"), "--devices", "cpu", "--overwrite",
                   "--model", str(tmp_path / "no-such-model")])
    assert rc == 2 and "no-such-model" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device)")
def test_two_workers_sharing_one_gpu_equal_one_process(tiny_shipped, files, tmp_path):
    """On the GPU: two engine processes on cuda:0 give each file exactly what one in-process CUDA engine gives
    (tokens, text, times), and a worker killed on the GPU has its files retried and restarts. fp32 on both
    sides: in bf16 another batch beside a file may round its logits differently (a different GEMM shape).
    The files go out once both workers are ready: before that the first one ready may take them all (by
    design: nobody waits for a slow starter; the H200 run of 2026-12-01 saw worker 0 finish all six first)."""
    import shutil

    _, paths = files
    asr = glmasr.load(tiny_shipped, device="cuda", dtype="float32")
    want = {str(p): glmasr.transcribe(str(p), model=asr, max_new_tokens=TOKENS) for p in paths}
    asr.close()
    with DevicePool("cuda:0,cuda:0", model=tiny_shipped, dtype="float32",
                    decode=glmasr.DecodeOptions(max_new_tokens=TOKENS), in_flight=2) as pool:
        workers = _bounded(lambda: pool.wait_ready(timeout=LIMIT_S))
        assert [w["state"] for w in workers] == ["ready", "ready"]
        out = _bounded(lambda: list(pool.run(paths)))
    assert {r.worker for r in out} == {0, 1}, "both workers should have had files"
    for r in out:
        assert r.ok and r.device == "cuda:0", r
        _same(r.result, want[r.path])
    poison = tmp_path / "poison.wav"
    shutil.copy(paths[0], poison)
    out = _bounded(lambda: transcribe_files([paths[0], poison, paths[2]], devices="cuda:0,cuda:0",
                                            model=tiny_shipped, dtype="float32", max_new_tokens=TOKENS,
                                            in_flight=2, retries=1,
                                            _test_hooks={"crash_on": "poison"}))
    assert not out[1].ok and "died" in out[1].error
    for r in (out[0], out[2]):
        assert r.ok, r
        _same(r.result, want[r.path])
