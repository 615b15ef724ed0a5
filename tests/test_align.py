"""Word times: CTC Viterbi, words from text, the CtcAligner end to end, and how GlmAsr / transcribe use it."""

from __future__ import annotations

import asyncio
import itertools
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import noise

from glmasr.align import AlignSegment, CtcAligner, ctc_viterbi, ctc_viterbi_batch, ctc_viterbi_batch_torch
from glmasr.align.ctc import min_frames
from glmasr.align.head import CtcHeadConfig
from glmasr.align.random_head import build_head_for_checkpoint
from glmasr.align.words import plan_words
from glmasr.checkpoint.random_weights import build_tokenizer

SR = 16000


# ---------------------------------------------------------------------------------------------- CTC Viterbi

def brute_force(lp: np.ndarray, targets: list[int], blank: int):
    """Best (score, frame labels) over every labelling of the frames that collapses to ``targets``."""
    best = None
    for seq in itertools.product(range(lp.shape[1]), repeat=lp.shape[0]):
        out, prev = [], None
        for c in seq:
            if c != prev and c != blank:
                out.append(c)
            prev = c
        if out == targets:
            score = float(sum(lp[t, c] for t, c in enumerate(seq)))
            if best is None or score > best[0]:
                best = (score, seq)
    return best


def labels(aln, targets, blank, T):
    """The frame labels of an alignment's path."""
    return tuple(targets[s // 2] if s % 2 else blank for s in aln.path[:T])


def designed(frames: list, classes: int, rng, sharp: float = 0.9) -> np.ndarray:
    """Log-posteriors whose best label at frame t is frames[t] (prob ``sharp``), the rest random."""
    p = rng.dirichlet(np.ones(classes), size=len(frames)) * (1 - sharp)
    for t, c in enumerate(frames):
        p[t, c] += sharp
    return np.log(p)


def test_viterbi_returns_a_designed_best_path():
    """Blanks around and between tokens, a token held for 3 frames, a repeat that needs a blank between."""
    rng = np.random.default_rng(10)
    blank, a, b, c = 0, 1, 2, 3
    frames = [blank, blank, a, a, a, blank, b, blank, b, b, c, blank]
    aln = ctc_viterbi(designed(frames, 4, rng), [a, b, b, c], blank)
    assert labels(aln, [a, b, b, c], blank, 12) == tuple(frames)
    assert aln.spans.tolist() == [[2, 5], [6, 7], [8, 10], [10, 11]]
    lp = designed(frames, 4, rng)
    aln = ctc_viterbi(lp, [a, b, b, c], blank)
    for (s, e), tok, prob in zip(aln.spans, [a, b, b, c], aln.probs):
        assert prob == pytest.approx(np.exp(lp[s:e, tok]).mean())


def test_viterbi_repeats_and_too_few_frames():
    rng = np.random.default_rng(11)
    lp = np.log(rng.dirichlet(np.ones(3), size=3))
    aln = ctc_viterbi(lp, [1, 1], 0)  # 3 frames: exactly 1, blank, 1
    assert aln.path.tolist() == [1, 2, 3] and aln.spans.tolist() == [[0, 1], [2, 3]]
    assert ctc_viterbi(lp[:2], [1, 1], 0) is None  # a repeat needs the blank between
    assert ctc_viterbi(lp[:2], [1, 2, 1], 0) is None
    assert min_frames([1, 1, 2, 2, 2]) == 8
    empty = ctc_viterbi(lp, [], 0)
    assert empty.spans.shape == (0, 2) and empty.path.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="blank id 0 cannot be a target"):
        ctc_viterbi(lp, [1, 0], 0)
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 3\)"):
        ctc_viterbi(lp, [3], 0)


def test_viterbi_matches_brute_force_on_random_cases():
    rng = np.random.default_rng(12)
    checked = 0
    for _ in range(120):
        T, C = int(rng.integers(1, 7)), int(rng.integers(2, 5))
        blank = int(rng.integers(0, C))
        others = [c for c in range(C) if c != blank]
        targets = [int(x) for x in rng.choice(others, size=int(rng.integers(0, 4)))]
        lp = np.log(rng.dirichlet(np.ones(C) * 0.7, size=T))
        got, want = ctc_viterbi(lp, targets, blank), brute_force(lp, targets, blank)
        assert (got is None) == (want is None), (T, targets)
        if want is None:
            continue
        checked += 1
        assert got.score == pytest.approx(want[0], abs=1e-9)
        assert labels(got, targets, blank, T) == want[1]
    assert checked > 60


def test_viterbi_batch_equals_one_at_a_time():
    rng = np.random.default_rng(13)
    items = []
    for T, L in ((40, 7), (5, 5), (23, 0), (60, 12), (3, 4)):
        targets = [int(x) for x in rng.integers(1, 9, size=L)]
        items.append((np.log(rng.dirichlet(np.ones(9), size=T)).astype(np.float32), targets))
    batch = ctc_viterbi_batch(items, blank=0)
    for (lp, tg), got in zip(items, batch):
        one = ctc_viterbi(lp, tg, 0)
        if one is None:
            assert got is None
            continue
        assert np.array_equal(got.path, one.path) and np.array_equal(got.spans, one.spans)
        assert got.score == pytest.approx(one.score)
    assert batch[4] is None  # 3 frames, 4 tokens


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_viterbi_torch_equals_numpy(device):
    """``ctc_viterbi_batch_torch`` (on CUDA the Triton kernel, kernels/ctc_viterbi.py; on the CPU its torch loop)
    against the numpy reference on fresh random batches: the same paths, spans, scores and probabilities, bit for
    bit (both sum in float64 in the same order). Every
    third batch has rounded log-posteriors, so ties between staying, stepping and skipping are common and the
    tie order is checked; some utterances have too few frames (no path), some no tokens."""
    rng = np.random.default_rng()
    compared = 0
    for trial in range(24):
        items = []
        for _ in range(int(rng.integers(1, 7))):
            T, C, L = int(rng.integers(1, 50)), int(rng.integers(2, 9)), int(rng.integers(0, 16))
            lp = np.log(rng.dirichlet(np.ones(C) * 0.7, size=T)).astype(np.float32)
            if trial % 3 == 0:
                lp = np.round(lp)
            items.append((lp, [int(x) for x in rng.integers(1, C, size=L)]))
        want = ctc_viterbi_batch(items, blank=0)
        got = ctc_viterbi_batch_torch([(torch.from_numpy(lp).to(device), tg) for lp, tg in items], blank=0)
        for w, g in zip(want, got):
            assert (w is None) == (g is None)
            if w is None:
                continue
            compared += 1
            assert np.array_equal(g.path, w.path) and np.array_equal(g.spans, w.spans)
            assert g.score == w.score and np.array_equal(g.probs, w.probs)
    assert compared > 40


# ---------------------------------------------------------------------------------------------- words

@pytest.fixture(scope="module")
def byte_tok():
    """The tiny checkpoint's tokenizer: byte-level BPE without merges (every byte a token, a space its own)."""
    tok = build_tokenizer().backend_tokenizer

    def encode(s):
        e = tok.encode(s, add_special_tokens=False)
        return e.ids, e.offsets
    return encode


@pytest.fixture(scope="module")
def merged_tok():
    """A GLM-like byte-level BPE with merges: word-start tokens carry the space ('Ġworld'), and Chinese runs
    merge into multi-character tokens ('你好')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["hello world hello world say hello to the world", "你好 你好 你好世界 世界你好"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=
                                                        pre_tokenizers.ByteLevel.alphabet(), show_progress=False))

    def encode(s):
        e = tok.encode(s, add_special_tokens=False)
        return e.ids, e.offsets
    encode.tokens = lambda s: tok.encode(s, add_special_tokens=False).tokens
    return encode


def words_of(plan):
    return [plan.word_text(j) for j in range(len(plan.words))]


def test_english_words_keep_their_text_and_align_lowercase_unpunctuated(byte_tok):
    text = "Hello, World. Don't stop\u2014now! (yes) U.S."
    plan = plan_words(text, byte_tok)
    assert words_of(plan) == ["Hello,", "World.", "Don't", "stop\u2014now!", "(yes)", "U.S."]
    assert plan.align_text == "hello world don't stop now yes u s"
    ids, _ = byte_tok(plan.align_text)
    assert plan.token_ids == ids
    # every token belongs to the word its characters came from; a space token to the word after it
    per_word = {}
    for tid, w in zip(plan.token_ids, plan.token_word):
        per_word.setdefault(w, []).append(tid)
    assert [bytes(byte_ids_text(per_word[w])) for w in range(6)] == [
        b"hello", b" world", b" don't", b" stop now", b" yes", b" u s"]
    assert plan.token_word == sorted(plan.token_word)


def byte_ids_text(ids):
    """The bytes of the tiny tokenizer's ids (its vocabulary is the ByteLevel alphabet in sorted order)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_of = {ch: b for b, ch in _byte_level_map().items()}
    return [byte_of[alphabet[i]] for i in ids]


def _byte_level_map():
    """GPT-2's bytes -> printable characters table (what ByteLevel encodes bytes as)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def test_chinese_is_one_word_per_character(byte_tok):
    plan = plan_words("你好，世界。我用iPhone拍照", byte_tok)
    assert words_of(plan) == ["你", "好，", "世", "界。", "我", "用", "iPhone", "拍", "照"]
    assert plan.align_text == "你好世界我用iphone拍照"
    # three byte tokens per character (byte-level BPE splits a character): all of them its word's
    assert plan.token_word == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3 + [5] * 3 + [6] * 6 + [7] * 3 + [8] * 3


def test_kana_hangul_quotes_and_text_without_sound(byte_tok):
    words = words_of(plan_words("「こんにちは」と안녕", byte_tok))
    assert words == ["「こ", "ん", "に", "ち", "は」", "と", "안", "녕"]
    for text in ("", "   ", "...", "——"):
        plan = plan_words(text, byte_tok)
        assert plan.token_ids == [] and plan.align_text == ""


def test_a_token_across_two_characters_makes_them_one_word(merged_tok):
    assert [bytes(_byte_level_inverse(t)).decode() for t in merged_tok.tokens("你好")] == ["你好"]
    plan = plan_words("你好，Hello world", merged_tok)
    assert words_of(plan) == ["你好，", "Hello", "world"]  # one token covers 你 and 好: no time for each
    assert words_of(plan_words("好(Hello，你", merged_tok)) == ["好", "(Hello，", "你"]
    tokens = merged_tok.tokens(plan.align_text)
    assert "Ġworld" in tokens and plan.token_word[tokens.index("Ġworld")] == 2


def _byte_level_inverse(token: str) -> list[int]:
    inv = {c: b for b, c in _byte_level_map().items()}
    return [inv[ch] for ch in token]


# ---------------------------------------------------------------------------------------------- end to end (stub)

BIN_SPACING = 8  # FFT bins (40 Hz each) between the tones of two token classes


class BandModel:
    """A stand-in encoder: each state is the log-mel of two frames averaged (the encoder's 2x stride), minus the
    window's floor: a function of the audio around that time only, so a time shift of the audio shifts it."""

    def __init__(self):
        self.cfg = SimpleNamespace(audio=SimpleNamespace(hidden_size=128, num_mel_bins=128))
        self.device = torch.device("cpu")
        self.dtype = torch.float32

    def encode_states(self, feats, frames=None):
        if frames is not None:  # the interface's contract: each window as if alone at its own length
            out = torch.zeros(feats.shape[0], (feats.shape[2] + 1) // 2, 128)
            for j, f in enumerate(frames):
                out[j, :(f + 1) // 2] = self.encode_states(feats[j:j + 1, :, :f])[0]
            return out
        if feats.shape[2] % 2:
            feats = torch.cat([feats, feats[:, :, -1:]], dim=2)
        w, m, f = feats.shape
        x = feats.reshape(w, m, f // 2, 2).mean(-1).transpose(1, 2)
        return x - x.amin(dim=(1, 2), keepdim=True)


class BandHead(torch.nn.Module):
    """Class v scores its own mel bin; blank scores a threshold: in a tone burst of v, v wins; in quiet, blank."""

    def __init__(self, bins: dict[int, int], vocab: int, gain: float = 20.0, threshold: float = 1.0):
        super().__init__()
        self.config = CtcHeadConfig(encoder_dim=128, vocab_size=vocab, blank_id=vocab - 1, num_blocks=0)
        a = torch.zeros(vocab, 128)
        for v, b in bins.items():
            a[v, b] = gain
        bias = torch.zeros(vocab)
        bias[vocab - 1] = gain * threshold
        self.a = torch.nn.Parameter(a, requires_grad=False)
        self.bias = torch.nn.Parameter(bias, requires_grad=False)

    def token_log_probs(self, states, classes):
        return torch.log_softmax(states.float() @ self.a.T + self.bias, dim=-1)[:, classes]


@pytest.fixture(scope="module")
def tones():
    """(aligner over BandModel/BandHead with the tiny tokenizer, audio maker): each token of a text is a 200 ms
    tone at its own frequency, 100 ms apart."""
    from glmasr.audio.features import mel_filter_bank

    tok = build_tokenizer()

    def encode(s):
        e = tok.backend_tokenizer.encode(s, add_special_tokens=False)
        return e.ids, e.offsets
    encode.size = len(tok)  # what CtcAligner checks against the head's classes
    filters = mel_filter_bank(128).numpy()  # (201 FFT bins, 128 mel bins)
    freq_of, bins = {}, {}

    def setup(text):
        for tid in plan_words(text, encode).token_ids:
            if tid not in freq_of:
                k = 12 + BIN_SPACING * len(freq_of)
                freq_of[tid], bins[tid] = k * 40.0, int(filters[k].argmax())
        head = BandHead(bins, len(tok) + 1)
        aligner = CtcAligner(head, encode, bias_correction=False)
        aligner.bind(BandModel())
        return aligner

    def audio(text, lead_s, tail_s=0.5, seed=0):
        rng = np.random.default_rng(seed)
        parts, truth = [rng.standard_normal(int(lead_s * SR)) * 1e-4], []
        t = lead_s
        ramp = np.minimum(1, np.minimum(np.arange(3200), np.arange(3200)[::-1]) / 80)
        for tid in plan_words(text, encode).token_ids:
            tone = 0.3 * np.sin(2 * np.pi * freq_of[tid] * np.arange(3200) / SR + rng.uniform(0, 6)) * ramp
            parts += [tone, rng.standard_normal(1600) * 1e-4]
            truth.append((t, t + 0.2))
            t += 0.3
        parts.append(rng.standard_normal(int(tail_s * SR)) * 1e-4)
        return np.concatenate(parts).astype(np.float32), truth
    return setup, audio, encode


@pytest.mark.parametrize("text", ["ab cd", "ok 你好"])
def test_word_times_follow_the_audio_and_one_second_of_silence_moves_them_by_one_second(tones, text):
    setup, audio, encode = tones
    aligner = setup(text)
    plan = plan_words(text, encode)
    x, truth = audio(text, lead_s=0.5)
    (words,) = aligner.align([AlignSegment(x, 0.0, text)])
    assert [w.word for w in words] == words_of(plan)
    for j, w in enumerate(words):  # each word spans its tokens' tone bursts, to within 2 frames
        toks = [k for k, wj in enumerate(plan.token_word) if wj == j]
        assert w.start == pytest.approx(truth[toks[0]][0], abs=0.04)
        assert w.end == pytest.approx(truth[toks[-1]][1], abs=0.04)
        assert 0.5 < w.probability <= 1
    shifted, _ = audio(text, lead_s=1.5)
    (later,) = aligner.align([AlignSegment(shifted, 0.0, text)])
    for a, b in zip(words, later):
        assert b.start - a.start == pytest.approx(1.0, abs=0.02) and b.end - a.end == pytest.approx(1.0, abs=0.02)
    (offset,) = aligner.align([AlignSegment(x, 12.5, text)])  # where the segment starts in the recording
    for a, b in zip(words, offset):
        assert (b.start, b.end) == pytest.approx((a.start + 12.5, a.end + 12.5), abs=1e-6)


def test_bias_correction_moves_starts_earlier_and_ends_later_within_bounds(tones):
    setup, audio, _ = tones
    text = "ab cd"
    aligner = setup(text)
    x, _ = audio(text, lead_s=0.05, tail_s=0.05)
    seg = AlignSegment(x, 3.0, text)
    (raw,) = aligner.align([seg])
    aligner.bias_correction = True
    (fixed,) = aligner.align([seg])
    aligner.bias_correction = False
    assert fixed[0].start == 3.0  # 105 ms earlier than ~3.05: clamped to the segment's start
    assert fixed[1].start == pytest.approx(raw[1].start - 0.105, abs=1e-6)
    assert fixed[0].end == pytest.approx(min(raw[0].end + 0.1, fixed[1].start), abs=1e-6)
    assert fixed[1].end == pytest.approx(min(raw[1].end + 0.1, 3.0 + seg.duration_s), abs=1e-6)
    for w, nxt in itertools.pairwise(fixed):
        assert w.start <= w.end <= nxt.start


def test_a_segment_with_more_tokens_than_frames_gets_no_words(tones):
    setup, _audio, _ = tones
    aligner = setup("ab")
    x = noise(0.1, seed=14)  # 5 frames for 60 tokens
    assert aligner.align([AlignSegment(x, 0.0, "ab" * 30), AlignSegment(x[:100], 0.0, "ab"),
                          AlignSegment(x, 0.0, "")]) == [[], [], []]


# ---------------------------------------------------------------------------------------------- the real encoder

@pytest.fixture(scope="module")
def head_folder(tiny_shipped, tmp_path_factory):
    return build_head_for_checkpoint(tmp_path_factory.mktemp("head"), tiny_shipped, size="small", seed=15)


@pytest.fixture(scope="module")
def aligned_asr(tiny_shipped, head_folder):
    import glmasr

    asr = glmasr.load(tiny_shipped, device="cpu", aligner=head_folder)
    yield asr
    asr.close()


def check_words(words, start, end, text):
    assert words and all(start <= w.start <= w.end <= end for w in words)
    assert all(a.end <= b.start for a, b in itertools.pairwise(words))
    assert all(0 <= w.probability <= 1 for w in words)
    at = 0
    for w in words:  # the words are the text's own pieces, in order
        at = text.index(w.word, at) + len(w.word)


def test_real_encoder_and_random_head_align_a_long_segment(aligned_asr):
    x = noise(31.0, seed=16)  # two encoder windows: 30 s + 1 s
    text = "Hello, world. 你好！ Again"
    (words,) = aligned_asr.aligner.align([AlignSegment(x, 3.0, text)])
    assert [w.word for w in words] == ["Hello,", "world.", "你", "好！", "Again"]
    check_words(words, 3.0, 34.0, text)
    states = aligned_asr.aligner._encode([x[:480000], x[480000:]], torch.device("cpu"))
    assert [tuple(s.shape) for s in states] == [(1500, 64), (50, 64)]  # unpadded: 50 states per second


def test_encode_states_is_the_encoder_before_the_projector(aligned_asr):
    from glmasr.audio.features import log_mel_windows

    model = aligned_asr.model
    x = torch.from_numpy(noise(30.0, seed=17))[None]
    feats = log_mel_windows(x)
    with torch.no_grad():
        states = model.encode_states(feats)
        torch.testing.assert_close(model.multi_modal_projector(states), model.encode_audio(feats))
        part = model.encode_states(feats[:, :, :777])
    assert part.shape == (1, 389, 64)
    with pytest.raises(ValueError, match="1..3000 frames"):
        model.encode_states(torch.randn(1, 128, 3002))


def test_mixed_length_windows_encode_as_if_alone(aligned_asr):
    """encode_states(features, frames): windows of different lengths in one call, each equal to its own call on
    exactly its frames (fp32 on the CPU: to 1e-5, the difference of GEMMs of other shapes and a masked softmax);
    odd and even lengths, one of full length, one of a single frame. Also what the aligner's _encode returns for
    mixed windows against one window at a time."""
    from glmasr.audio.features import log_mel_windows

    model = aligned_asr.model
    rng = np.random.default_rng()
    frames = [1, 777, int(rng.integers(100, 1500)) * 2, int(rng.integers(100, 1500)) * 2 + 1, 3000]
    x = torch.from_numpy(rng.standard_normal((len(frames), 480000)).astype(np.float32) * 0.1)
    feats = log_mel_windows(x)
    with torch.no_grad():
        batched = model.encode_states(feats[:, :, :max(frames)], frames)
        for j, f in enumerate(frames):
            alone = model.encode_states(feats[j:j + 1, :, :f])[0]
            torch.testing.assert_close(batched[j, :(f + 1) // 2], alone, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="frames must be one length in 1..3000 per window"):
        model.encode_states(feats, [3000] * 4)
    with pytest.raises(ValueError, match="frames must be one length"):
        model.encode_states(feats, [0, 5, 5, 5, 5])
    aligner = aligned_asr.aligner
    windows = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (16000 * 7 + 37, 480000, 16000 * 3)]
    with torch.no_grad():
        together = aligner._encode(windows, model.device)
        for w, got in zip(windows, together):
            torch.testing.assert_close(got, aligner._encode([w], model.device)[0], rtol=1e-5, atol=1e-5)


def test_fast_model_encode_states_equals_the_reference(tiny_shipped):
    pytest.importorskip("triton")
    import glmasr
    from glmasr.models.fast import FastGlmAsrModel

    # the Triton model path wants CUDA weights (on the CPU, the interpreter conftest turns on)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    asr = glmasr.load(tiny_shipped, device=device)  # its own: the fast model re-points the reference's weights
    try:
        fast = FastGlmAsrModel(asr.model)
        feats = torch.randn(2, 128, 400, device=device)
        with torch.no_grad():
            assert torch.equal(fast.encode_states(feats), asr.model.encode_states(feats))
    finally:
        asr.close()


def test_jobs_with_word_timestamps_get_words_per_segment(aligned_asr):
    import glmasr

    x = noise(40.0, seed=18)
    r = aligned_asr.submit(x, glmasr.DecodeOptions(word_timestamps=True, max_new_tokens=12), sampling_rate=SR).result()
    assert "align_ms" in r.timings_ms and r.timings_ms["total_ms"] >= r.timings_ms["align_ms"] > 0
    for seg in r.segments:
        assert isinstance(seg.words, list)
        if seg.text:
            check_words(seg.words, seg.start, seg.end, seg.text)
    plain = aligned_asr.submit(x, glmasr.DecodeOptions(max_new_tokens=12), sampling_rate=SR).result()
    assert all(s.words is None for s in plain.segments) and "align_ms" not in plain.timings_ms
    assert [s.text for s in plain.segments] == [s.text for s in r.segments]


def test_word_timestamps_through_streaming_and_asyncio(aligned_asr):
    import glmasr

    x = noise(6.0, seed=19)
    opts = glmasr.DecodeOptions(word_timestamps=True, max_new_tokens=10)
    last = list(aligned_asr.submit(x, opts, sampling_rate=SR).deltas())[-1]
    assert last.finished and last.result.segments[0].words is not None
    r = asyncio.run(aligned_asr.submit(x, opts, sampling_rate=SR).aresult())
    assert [s.words for s in r.segments] == [s.words for s in last.result.segments]


def test_align_from_many_threads_equals_one_at_a_time(aligned_asr):
    segs = [AlignSegment(noise(4.0 + i, seed=20 + i), float(i), "one two three 四五") for i in range(3)]
    want = aligned_asr.aligner.align(segs)
    got = [None] * 4

    def run(k):
        got[k] = aligned_asr.aligner.align(segs)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == [want] * 4


def test_word_timestamps_without_an_aligner_is_refused(tiny_asr):
    import glmasr

    with pytest.raises(ValueError, match=r"word_timestamps=True needs an aligner.*aligner=PATH.*--aligner PATH"):
        tiny_asr.submit(noise(1.0, seed=24), glmasr.DecodeOptions(word_timestamps=True), sampling_rate=SR)


def test_transcribe_loads_the_aligner_it_is_given(tiny_shipped, head_folder, tiny_asr):
    import glmasr

    x = noise(3.0, seed=25)
    with pytest.raises(ValueError, match="needs an aligner"):
        glmasr.transcribe(x, model=tiny_shipped, sampling_rate=SR, word_timestamps=True, max_new_tokens=5)
    try:
        r = glmasr.transcribe(x, model=tiny_shipped, sampling_rate=SR, word_timestamps=True, max_new_tokens=5,
                              aligner=head_folder)
        assert r.segments[0].words is not None
        last = list(glmasr.transcribe_stream(x, model=tiny_shipped, sampling_rate=SR, word_timestamps=True,
                                             max_new_tokens=5, aligner=head_folder))[-1]
        assert last.result.segments[0].words == r.segments[0].words
    finally:
        glmasr.close_shared_model()
    with pytest.raises(ValueError, match=r"aligner= is for a model transcribe\(\) loads itself"):
        glmasr.transcribe(x, model=tiny_asr, sampling_rate=SR, aligner=head_folder)
