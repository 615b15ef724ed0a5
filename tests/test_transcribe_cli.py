"""`glmasr transcribe FILES_OR_DIRS...`: outputs per file, corrupt files reported and skipped, existing outputs
kept unless --overwrite."""

import json

import pytest
import soundfile as sf

import glmasr
from glmasr import cli
from glmasr.tokenizer import DEFAULT_PROMPT, build_instruction
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


def test_folder_with_a_corrupt_file(folder, tmp_path, tiny_shipped, capsys):
    out = tmp_path / "out"
    rc = cli.main(["transcribe", str(folder), "--model", str(tiny_shipped), "-f", "txt,srt,json", "-o", str(out)]
                  + ARGS)
    err = capsys.readouterr().err
    assert rc == 1 and "broken.wav" in err and "3 of 4 file(s) transcribed" in err
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{s}.{f}" for s in "abc" for f in ("txt", "srt", "json"))
    asr = glmasr.load(tiny_shipped, device="cpu")
    for stem, path in (("a", folder / "a.wav"), ("b", folder / "b.flac"), ("c", folder / "sub" / "c.wav")):
        r = glmasr.transcribe(str(path), model=asr, max_new_tokens=4)
        assert (out / f"{stem}.srt").read_text() == render(r, "srt")
        assert (out / f"{stem}.txt").read_text() == r.text + "\n"
        assert json.loads((out / f"{stem}.json").read_text())["text"] == r.text
    asr.close()

    (out / "a.txt").write_text("kept")
    rc = cli.main(["transcribe", str(folder / "a.wav"), str(folder / "sub"), "--model", str(tiny_shipped),
                   "-f", "txt,srt,json", "-o", str(out)] + ARGS)
    err = capsys.readouterr().err
    assert rc == 0 and err.count("skipped") == 2 and (out / "a.txt").read_text() == "kept"
    rc = cli.main(["transcribe", str(folder / "a.wav"), "--model", str(tiny_shipped), "-f", "txt", "-o", str(out),
                   "--overwrite"] + ARGS)
    assert rc == 0 and (out / "a.txt").read_text() != "kept"


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


def test_hotwords_in_the_instruction():
    assert build_instruction(None, []) is None and build_instruction("Say it", []) == "Say it"
    assert build_instruction(None, [" GLM ", "Zhipu"]) == f"{DEFAULT_PROMPT}\nHotwords: GLM, Zhipu"
    with pytest.raises(ValueError, match="hotwords"):
        build_instruction("x", ["ok", " "])
