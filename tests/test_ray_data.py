"""glmasr.integrations.ray_data: GlmAsrPredictor on rows of paths, bytes and arrays (called directly, and in a
real local Ray with two CPUs through ``map_batches``), bad rows in the error column, and
examples/ray_transcribe.py end to end. Results equal ``glmasr.transcribe`` of the same audio."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

import glmasr

from conftest import bounded, noise

pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install 'glmasr[ray]')")

REPO = Path(__file__).resolve().parent.parent
TOKENS = 4
LIMIT_S = 180


def _bounded(fn, timeout=LIMIT_S):
    return bounded(fn, timeout)


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray_audio")
    for i, (name, seconds, rate) in enumerate([("a.wav", 2.0, 16000), ("b.flac", 33.0, 16000),
                                               ("c.wav", 1.5, 22050)]):
        sf.write(d / name, noise(seconds, 60 + i, rate), rate)
    (d / "broken.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunk" + bytes(range(64)))
    return d


@pytest.fixture(scope="module")
def asr(tiny_shipped):
    a = glmasr.load(tiny_shipped, device="cpu")
    yield a
    a.close()


def _check_row(row, want, path=None):
    assert row["error"] is None, row["error"]
    assert row["text"] == want.text and row["finish_reason"] == want.finish_reason
    assert row["duration_s"] == pytest.approx(want.duration_s) and row["num_windows"] == want.num_windows
    segs = list(row["segments"])
    assert [(s["start"], s["end"], s["text"], list(s["tokens"])) for s in segs] == \
        [(s.start, s.end, s.text, s.token_ids) for s in want.segments]
    json.dumps([dict(s, tokens=list(s["tokens"])) for s in segs])  # plain JSON-able values
    assert row["total_ms"] > 0
    if path is not None:
        assert row["path"] == path


def test_predictor_on_paths_bytes_and_arrays(tiny_shipped, audio_dir, asr):
    from glmasr.integrations.ray_data import GlmAsrPredictor

    pred = GlmAsrPredictor(model=str(tiny_shipped), device="cpu", max_new_tokens=TOKENS)
    files = sorted(audio_dir.iterdir())  # a.wav, b.flac, broken.wav, c.wav
    want = {str(p): glmasr.transcribe(str(p), model=asr, max_new_tokens=TOKENS)
            for p in files if p.name != "broken.wav"}

    # paths (a dict of numpy arrays: Ray's default batch format)
    out = pred({"path": np.array([str(p) for p in files], dtype=object), "id": np.arange(4)}).to_pylist()
    assert [r["id"] for r in out] == [0, 1, 2, 3]
    for p, row in zip(files, out):
        if p.name == "broken.wav":
            assert row["text"] is None and row["segments"] == [] and "broken.wav" in row["error"]
            assert row["duration_s"] is None
        else:
            _check_row(row, want[str(p)], str(p))

    # bytes + path, as read_binary_files gives them (the bytes are decoded, the path names the row)
    out = pred({"bytes": np.array([p.read_bytes() for p in files], dtype=object),
                "path": np.array([str(p) for p in files], dtype=object)}).to_pylist()
    assert "bytes" not in out[0]
    for p, row in zip(files, out):
        if p.name == "broken.wav":
            assert "broken.wav" in row["error"]
        else:
            _check_row(row, want[str(p)], str(p))

    # arrays with a rate column, in a pandas batch; a NaN row and a too-short row fail alone
    import pandas as pd

    x = noise(2.5, 70, 8000)
    df = pd.DataFrame({"array": [x, np.array([np.nan] * 4000, np.float32), x[:100]],
                       "sampling_rate": [8000, 8000, 8000]})
    out = pred(df).to_pylist()
    _check_row(out[0], glmasr.transcribe(x, model=asr, sampling_rate=8000, max_new_tokens=TOKENS))
    assert "NaN" in out[1]["error"] and out[2]["error"] and out[2]["text"] is None
    assert out[1]["error"].startswith("row 1")

    # a pyarrow batch of Hugging Face style audio dicts, no rate column: the rate from the dict
    tbl = pa.table({"audio": [{"array": x.tolist(), "sampling_rate": 8000}]})
    _check_row(pred(tbl).to_pylist()[0], glmasr.transcribe(x, model=asr, sampling_rate=8000, max_new_tokens=TOKENS))

    with pytest.raises(KeyError, match="no audio column"):
        pred({"other": np.array([1])})


def test_bytes_through_a_temporary_file_without_decode_audio_bytes(tiny_shipped, audio_dir, asr, monkeypatch):
    """A glmasr whose audio module lacks decode_audio_bytes: the bytes go through a temporary file, same result."""
    from glmasr import audio as audio_mod
    from glmasr.integrations.ray_data import GlmAsrPredictor

    monkeypatch.delattr(audio_mod, "decode_audio_bytes", raising=False)
    pred = GlmAsrPredictor(model=str(tiny_shipped), device="cpu", max_new_tokens=TOKENS)
    files = [audio_dir / "a.wav", audio_dir / "broken.wav"]
    out = pred({"bytes": np.array([p.read_bytes() for p in files], dtype=object),
                "path": np.array([str(p) for p in files], dtype=object)}).to_pylist()
    _check_row(out[0], glmasr.transcribe(str(files[0]), model=asr, max_new_tokens=TOKENS), str(files[0]))
    assert "broken.wav" in out[1]["error"] and "glmasr-ray-" not in out[1]["error"]


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'glmasr[ray]')")
    pytest.importorskip("ray.data", reason="ray.data needs ray[data] (pip install 'glmasr[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


def test_map_batches_in_a_local_ray(ray_session, tiny_shipped, audio_dir, asr):
    from glmasr.integrations.ray_data import GlmAsrPredictor

    ray = ray_session
    ds = ray.data.read_binary_files(str(audio_dir), include_paths=True)
    ds = ds.map_batches(GlmAsrPredictor, batch_size=2, concurrency=2, num_cpus=0.5,
                        fn_constructor_kwargs={"model": str(tiny_shipped), "device": "cpu",
                                               "max_new_tokens": TOKENS})
    rows = sorted(_bounded(ds.take_all), key=lambda r: r["path"])
    assert [Path(r["path"]).name for r in rows] == ["a.wav", "b.flac", "broken.wav", "c.wav"]
    for r in rows:
        if r["path"].endswith("broken.wav"):
            assert r["error"] and "broken.wav" in r["error"] and r["text"] is None
        else:
            _check_row(r, glmasr.transcribe(r["path"], model=asr, max_new_tokens=TOKENS))


def test_example_script_writes_jsonl_and_parquet(ray_session, tiny_shipped, audio_dir, asr, tmp_path):
    spec = importlib.util.spec_from_file_location("ray_transcribe", REPO / "examples" / "ray_transcribe.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ray_transcribe"] = mod
    spec.loader.exec_module(mod)
    listing = tmp_path / "files.txt"
    listing.write_text("# two of them\n" + "\n".join(str(audio_dir / n) for n in ("a.wav", "broken.wav")) + "\n")
    common = ["--model", str(tiny_shipped), "--device", "cpu", "--num-gpus", "0", "--num-cpus", "1",
              "--max-new-tokens", str(TOKENS), "--batch-size", "4"]
    assert _bounded(lambda: mod.main(["@" + str(listing), "--output", str(tmp_path / "jl"), "--format", "jsonl"]
                                     + common)) == 0
    rows = [json.loads(line) for f in sorted((tmp_path / "jl").iterdir()) for line in f.read_text().splitlines()]
    rows.sort(key=lambda r: r["path"])
    assert [Path(r["path"]).name for r in rows] == ["a.wav", "broken.wav"]
    _check_row(rows[0], glmasr.transcribe(str(audio_dir / "a.wav"), model=asr, max_new_tokens=TOKENS))
    assert rows[1]["error"] and rows[1]["text"] is None

    assert _bounded(lambda: mod.main([str(audio_dir), "--output", str(tmp_path / "pq")] + common)) == 0
    import pyarrow.parquet as pq

    table = pq.read_table(str(tmp_path / "pq"))
    assert sorted(Path(p).name for p in table.column("path").to_pylist()) == \
        ["a.wav", "b.flac", "broken.wav", "c.wav"]
    assert table.schema.field("segments").type.value_type.get_field_index("tokens") >= 0
