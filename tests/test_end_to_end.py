"""Our greedy tokens equal transformers generate(do_sample=False), fp32 on CPU, on the tiny checkpoint."""

import json
import shutil

import numpy as np
import pytest
import torch

import glmasr
from glmasr.pipeline import MAX_WINDOWS_PER_PROMPT, default_max_new_tokens

from conftest import noise

MAX_NEW = 24


def hf_generate(oracle, audios, max_new_tokens=MAX_NEW, prompt=None):
    processor, model = oracle
    inputs = processor.apply_transcription_request(audios, prompt=prompt)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    eos = set(model.config.text_config.eos_token_id)
    results = []
    for row in out[:, inputs["input_ids"].shape[1]:].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), None)
        results.append((row, "length") if cut is None else (row[:cut], "stop"))
    return results


def assert_same_greedy_tokens(ours, ref, oracle, audio, prompt=None):
    """Token lists must be equal. The only accepted difference is a genuine near-tie: at the first differing
    step, transformers' own top-2 logits are within 1e-5 (fp32 rounding of two different but equivalent
    op orders can flip such a tie); anything else is a real mismatch."""
    if ours == ref:
        return
    j = next(i for i in range(min(len(ours), len(ref)) + 1) if i >= min(len(ours), len(ref)) or ours[i] != ref[i])
    processor, model = oracle
    inputs = processor.apply_transcription_request([audio], prompt=prompt)
    ids = torch.cat([inputs["input_ids"], torch.tensor([ref[:j]], dtype=torch.long)], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=inputs["input_features"],
                       input_features_mask=inputs["input_features_mask"]).logits[0, -1]
    top2 = logits.topk(2).values
    assert (top2[0] - top2[1]).item() < 1e-5, f"tokens differ at step {j}: ours {ours[j:j + 5]}, ref {ref[j:j + 5]}"


@pytest.mark.parametrize("seconds", [[3.5], [30.0], [70.0], [1.0, 12.0, 45.0]],
                         ids=["3.5s", "30s", "70s-3windows", "batch-1-12-45s"])
def test_greedy_tokens_equal_transformers(tiny_asr, hf_oracle, seconds):
    audios = [noise(s, seed=i + int(10 * s)) for i, s in enumerate(seconds)]
    expected = hf_generate(hf_oracle, audios)
    results = glmasr.transcribe(audios, model=tiny_asr, sampling_rate=16000, max_new_tokens=MAX_NEW)
    for r, (ids, reason), s, audio in zip(results, expected, seconds, audios):
        assert_same_greedy_tokens(r.token_ids, ids, hf_oracle, audio)
        if r.token_ids == ids:
            assert r.finish_reason == reason
        assert r.num_windows == max(1, int(np.ceil(s / 30)))
        assert r.duration_s == pytest.approx(s)


def test_single_item_matches_its_batched_self(tiny_asr):
    audios = [noise(2.0, 1), noise(40.0, 2)]
    batched = glmasr.transcribe(audios, model=tiny_asr, sampling_rate=16000, max_new_tokens=MAX_NEW)
    alone = glmasr.transcribe(audios[1], model=tiny_asr, sampling_rate=16000, max_new_tokens=MAX_NEW)
    assert alone.token_ids == batched[1].token_ids


@pytest.fixture
def eos_override(tiny_shipped, tmp_path, hf_oracle):
    """A copy of the tiny checkpoint whose eos set includes a token the model really emits mid-sequence,
    so that both implementations must stop there (the random model never picks its own eos ids)."""
    free = hf_generate(hf_oracle, [noise(3.5, 35)], max_new_tokens=12)[0][0]
    stop_token = free[5]
    folder = tmp_path / "eos"
    shutil.copytree(tiny_shipped, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["eos_token_id"] = [cfg["text_config"]["eos_token_id"][0], stop_token]
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, stop_token, free[: free.index(stop_token)]


def test_stops_at_any_eos_id(eos_override):
    folder, stop_token, expected = eos_override
    asr = glmasr.load(folder, device="cpu")
    r = glmasr.transcribe(noise(3.5, 35), model=asr, sampling_rate=16000, max_new_tokens=12)
    assert r.finish_reason == "stop" and r.token_ids == expected and stop_token not in r.token_ids
    forced = glmasr.transcribe(noise(3.5, 35), model=asr, sampling_rate=16000, max_new_tokens=12, ignore_eos=True)
    assert forced.finish_reason == "length" and len(forced.token_ids) == 12


def test_stage_timings_add_up(tiny_asr):
    """audio + encoder (features included) + decoder = total; feature packing is a part of the encoder stage,
    the wait in the engine's queue a part of the decoder stage. The engine's marks come in order: queue (its first
    encoder work) <= admit (its prefill launched) <= engine (its end read back) <= total - audio; the server's
    stage histogram splits the same time into four parts that add up to it."""
    from glmasr.server.metrics import STAGES, stage_seconds

    r = glmasr.transcribe(noise(3.5, seed=3), model=tiny_asr, sampling_rate=16000, max_new_tokens=4)
    t = r.timings_ms
    assert set(t) == {"audio_ms", "features_ms", "encoder_ms", "queue_ms", "admit_ms", "engine_ms", "decoder_ms",
                      "total_ms"}
    assert all(v > 0 for v in t.values()), t
    assert t["audio_ms"] + t["encoder_ms"] + t["decoder_ms"] == pytest.approx(t["total_ms"], rel=1e-9)
    assert t["features_ms"] <= t["encoder_ms"] and t["queue_ms"] <= t["decoder_ms"]
    assert t["queue_ms"] <= t["admit_ms"] <= t["engine_ms"] <= t["total_ms"] - t["audio_ms"]
    # the CPU runs the encoder eagerly between the queue and the admission marks
    assert t["admit_ms"] - t["queue_ms"] >= 0.5 * t["encoder_ms"]
    stages = stage_seconds(t)
    assert set(stages) == set(STAGES) and all(v >= 0 for v in stages.values())
    assert 1e3 * sum(stages.values()) == pytest.approx(t["total_ms"] - t["audio_ms"], rel=1e-9)
    assert stage_seconds({k: v for k, v in t.items() if k != "engine_ms"}) is None


def test_default_budget_grows_with_duration(tiny_asr):
    assert default_max_new_tokens(3.5) < default_max_new_tokens(30) < default_max_new_tokens(300)
    r = glmasr.transcribe(noise(3.5, 8), model=tiny_asr, sampling_rate=16000, ignore_eos=True)
    assert len(r.token_ids) == default_max_new_tokens(3.5) and r.finish_reason == "length"


def test_audio_beyond_630s_is_not_cut(tiny_asr):
    seconds = 30 * MAX_WINDOWS_PER_PROMPT + 20.0  # 650 s: 22 windows, beyond the reference's cap
    r = glmasr.transcribe(noise(seconds, 3), model=tiny_asr, sampling_rate=16000, max_new_tokens=4)
    assert r.num_windows == 22 and r.num_groups == 2
    assert r.num_audio_tokens == 21 * 375 + 250  # every window contributes its tokens
    assert len(r.token_ids) == 8  # both groups decoded


def test_custom_prompt_changes_the_input(tiny_asr, hf_oracle):
    audio = noise(3.5, 21)
    expected = hf_generate(hf_oracle, [audio], prompt="Transcribe in French")[0]
    r = glmasr.transcribe(audio, model=tiny_asr, sampling_rate=16000, max_new_tokens=MAX_NEW,
                          prompt="Transcribe in French")
    assert_same_greedy_tokens(r.token_ids, expected[0], hf_oracle, audio, prompt="Transcribe in French")


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_max_new_tokens(tiny_asr, bad):
    with pytest.raises(ValueError, match="max_new_tokens"):
        glmasr.transcribe(noise(1.0, 1), model=tiny_asr, sampling_rate=16000, max_new_tokens=bad)


def test_budget_that_cannot_fit_the_context(tiny_asr):
    with pytest.raises(ValueError, match="leaves no room"):
        glmasr.transcribe(noise(31.0, 1), model=tiny_asr, sampling_rate=16000, max_new_tokens=8000)


def test_transcribe_accepts_paths_and_model_folders(tiny_shipped, tmp_path):
    import soundfile as sf

    path = tmp_path / "clip.flac"
    sf.write(path, noise(2.0, 5), 16000, subtype="PCM_16")
    r = glmasr.transcribe(str(path), model=str(tiny_shipped), device="cpu", max_new_tokens=3)
    assert isinstance(r, glmasr.Transcription) and len(r.token_ids) == 3 and isinstance(r.text, str)


def test_demo_runs_offline_with_tiny_random(tmp_path, monkeypatch):
    from glmasr import cli

    monkeypatch.setattr(cli.common, "TINY_RANDOM", tmp_path / "tiny-random")
    assert cli.main(["--model", "tiny-random", "--device", "cpu", "--max-new-tokens", "4"]) == 0
    assert (tmp_path / "tiny-random" / "model.safetensors").exists()


def test_demo_without_weights_or_network_exits_nonzero(monkeypatch, tmp_path, capsys):
    from glmasr import cli

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(cli.common, "LOCAL_WEIGHTS", tmp_path / "none")
    assert cli.main(["--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--model /path/to/GLM-ASR-Nano-2512" in err and "--model tiny-random" in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device)")
def test_cuda_fp32_reference_path_tokens_equal_cpu(tiny_shipped):
    audios = [noise(3.5, 1), noise(45.0, 2)]
    cpu = glmasr.transcribe(audios, model=glmasr.load(tiny_shipped, device="cpu"), sampling_rate=16000,
                            max_new_tokens=MAX_NEW)
    gpu = glmasr.transcribe(audios, model=glmasr.load(tiny_shipped, device="cuda", dtype="float32", backend="torch"),
                            sampling_rate=16000, max_new_tokens=MAX_NEW)
    assert [r.token_ids for r in gpu] == [r.token_ids for r in cpu]


def test_teacher_forced_logits_match_transformers(tiny_asr, hf_oracle):
    """fp32 logits over a 3.5 s prompt plus 10 forced tokens: same function, so differences are rounding
    (observed ~1e-7); 1e-5 relative to the largest logit leaves room for BLAS order."""
    from glmasr.pipeline import teacher_forced_logits

    processor, model = hf_oracle
    audio = noise(3.5, 77)
    forced = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    ours, prompt_ids = teacher_forced_logits(tiny_asr, audio, forced, sampling_rate=16000)
    inputs = processor.apply_transcription_request([audio])
    assert inputs["input_ids"][0].tolist() == prompt_ids
    ids = torch.cat([inputs["input_ids"], torch.tensor([forced])], dim=1)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask, input_features=inputs["input_features"],
                    input_features_mask=inputs["input_features_mask"]).logits[0, len(prompt_ids) - 1:]
    assert ours.shape == ref.shape
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_unwritten_kv_slots_never_reach_results(tiny_asr, nan_kv_cache):
    """Regression (seen on the H200: uninitialised cache memory turned a batch's short sequence into NaN):
    poison the whole KV buffer with NaN before use; every result must be unchanged."""
    audios = [noise(1.0, 12), noise(12.0, 13), noise(45.0, 14)]
    clean = glmasr.transcribe(audios, model=tiny_asr, sampling_rate=16000, max_new_tokens=MAX_NEW)
    nan_kv_cache(tiny_asr)
    poisoned = glmasr.transcribe(audios, model=tiny_asr, sampling_rate=16000, max_new_tokens=MAX_NEW)
    assert [r.token_ids for r in poisoned] == [r.token_ids for r in clean]


def test_tail_window_without_audio_tokens(tiny_asr, hf_oracle):
    """30 s + 50 ms: the second window yields no audio token (it is not encoded); tokens still match
    transformers, which counts audio tokens over the summed mask of both windows."""
    audio = noise(30.05, 41)
    expected = hf_generate(hf_oracle, [audio])[0]
    r = glmasr.transcribe(audio, model=tiny_asr, sampling_rate=16000, max_new_tokens=MAX_NEW)
    assert r.num_windows == 2 and r.num_audio_tokens == 375
    assert_same_greedy_tokens(r.token_ids, expected[0], hf_oracle, audio)
