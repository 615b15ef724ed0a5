"""Speech-shaped segments (``DecodeOptions(segmentation="vad", max_segment_s=S)``, glmasr/audio/vad.py
``segment_options`` / ``merge_regions(follow_pauses=True)``, glmasr/pipeline.py ``plan_audio``): on espeak-ng phrases
joined by silences of known lengths, every segment edge lies within 150 ms of a phrase's start or end, cuts follow
the pauses (the longest ones first, never merged across a pause of 1 s or more), no segment is longer than S, one
long unbroken run of speech is cut into the fewest pieces of at most S, the segments carry those times; the merge
rule against a brute-force search on random regions; the 30 s packing and the "windows" default unchanged.

Needs the ``vad`` extra (silero-vad) and the ``espeak-ng`` and ``sox`` programs for the speech tests.
"""

from __future__ import annotations

import itertools
import math
import shutil

import numpy as np
import pytest

pytest.importorskip("safetensors")
try:
    import importlib.metadata as _md

    _md.distribution("silero-vad")
except Exception:  # pragma: no cover - the test extra installs it
    pytest.skip("the silero-vad wheel is not installed (pip install glmasr[vad])", allow_module_level=True)

import glmasr  # noqa: E402
from glmasr.audio import vad  # noqa: E402

SR = 16000
EDGE_TOL_S = 0.15  # a segment edge vs the phrase start or end it should sit at (the bound)
MAX_S = 7.0

# (phrase, pause after it in seconds). Expected pieces at max_segment_s=7: [0, 1] (merged over a 0.7 s pause),
# cut at 1.5 s; [2, 3], [4]: the three span ~8.4 s, more than 7, and both two-piece cuts fit: the cut goes at the
# longer pause (0.8 s, not 0.6 s); cut at 2.5 s; [5, 6] (a short answer merged over 0.6 s); cut at 1.3 s; [7].
SCRIPT = [
    ("Good morning everyone.", 0.7),
    ("Thank you all for coming today.", 1.5),
    ("Our first topic is the budget for next year.", 0.6),
    ("We have to make some hard choices.", 0.8),
    ("Let me explain the three main options.", 2.5),
    ("The first option keeps every team at its present size.", 0.6),
    ("Yes.", 1.3),
    ("That is all for now.", 0.0),
]
EXPECTED_GROUPS = [[0, 1], [2, 3], [4], [5, 6], [7]]
LEAD_S = 1.1  # noise before the first phrase
NOISE = 0.003
# Continuous speech, no punctuation, no word gaps (-g 0): one VAD region of ~20 s.
RUN_TEXT = ("the morning train to the city was full of people reading their papers and drinking coffee while the "
            "rain kept falling on the windows and the conductor walked slowly along the narrow aisle checking every "
            "ticket with great care and a friendly word for each of the many travellers who were going to work in "
            "the tall offices near the river")


def _speech(text: str, tmp: str, *extra: str) -> np.ndarray:
    """espeak-ng speech at 16 kHz (sox), 0.5 x full scale, cut to its true extent (espeak pads each clip with
    ~0.35 s of silence)."""
    import os
    import subprocess

    import soundfile as sf

    from test_vad import _extent

    raw, out = os.path.join(tmp, "espeak.wav"), os.path.join(tmp, "16k.wav")
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", *extra, "-w", raw, text], check=True,
                   capture_output=True)
    subprocess.run(["sox", raw, "-r", str(SR), "-c", "1", "-b", "16", out], check=True, capture_output=True)
    x, sr = sf.read(out, dtype="float32")
    assert sr == SR
    a, b = _extent(x)
    return 0.5 * x[int(round(a * SR)): int(round(b * SR))]


def _noise(n: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * NOISE).astype(np.float32)


@pytest.fixture(scope="module")
def talk(tmp_path_factory):
    """Phrases joined by the silences of SCRIPT, in low noise: (recording, [(start_s, end_s)] of each phrase)."""
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        pytest.skip("espeak-ng and sox are not installed (Debian: apt-get install -y espeak-ng sox)")
    tmp = str(tmp_path_factory.mktemp("talk"))
    parts, truth, pos = [np.zeros(int(LEAD_S * SR), np.float32)], [], int(LEAD_S * SR)
    for text, pause in SCRIPT:
        x = _speech(text, tmp)
        truth.append((pos / SR, (pos + len(x)) / SR))
        parts += [x, np.zeros(int(round((pause or 1.0) * SR)), np.float32)]
        pos += len(x) + parts[-1].shape[0]
    rec = np.concatenate(parts)
    return rec + _noise(len(rec), 11), truth


@pytest.fixture(scope="module")
def talk_probs(talk):
    """The VAD's probabilities over ``talk`` (one pass for the tests that try several settings on them)."""
    return vad.speech_probabilities(talk[0], device="cpu")


def _pieces(rec, probs, max_segment_s):
    """What ``segment(rec, **segment_options(max_segment_s))`` gives, from probabilities computed once."""
    opts = vad.segment_options(max_segment_s)
    region_keys = ("speech_pad_ms", "end_pad_ms")
    regions = vad.regions_from_probabilities(probs, len(rec), **{k: opts[k] for k in region_keys if k in opts})
    return vad.merge_regions(regions, probs=probs, **{k: v for k, v in opts.items() if k not in region_keys})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """~20 s of continuous speech between 1 s of noise on each side: (recording, (start_s, end_s) of the speech)."""
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        pytest.skip("espeak-ng and sox are not installed (Debian: apt-get install -y espeak-ng sox)")
    x = _speech(RUN_TEXT, str(tmp_path_factory.mktemp("run")), "-g", "0")
    rec = np.concatenate([np.zeros(SR, np.float32), x, np.zeros(SR, np.float32)])
    return rec + _noise(len(rec), 12), (1.0, 1.0 + len(x) / SR)


def _span(truth, i, j):
    return truth[j][1] - truth[i][0]


# -- on speech with known pauses ------------------------------------------------------------------------------------
def test_pieces_follow_the_pauses(talk, talk_probs):
    rec, truth = talk
    # The script does what its comment says (espeak-ng's voice sets these lengths; a new version may not).
    assert _span(truth, 2, 4) > MAX_S + 0.5 and _span(truth, 2, 3) < MAX_S - 1.0 and _span(truth, 3, 4) < MAX_S - 1.0
    assert max(_span(truth, g[0], g[-1]) for g in EXPECTED_GROUPS) < MAX_S - 0.5
    pieces = vad.segment(rec, device="cpu", **vad.segment_options(MAX_S))
    assert pieces == _pieces(rec, talk_probs, MAX_S)
    assert len(pieces) == len(EXPECTED_GROUPS), (pieces, truth)
    for (a, b), group in zip(pieces, EXPECTED_GROUPS):
        assert 0 < b - a <= MAX_S
        assert abs(a - truth[group[0]][0]) <= EDGE_TOL_S, ((a, b), truth[group[0]])  # starts at a phrase start
        assert abs(b - truth[group[-1]][1]) <= EDGE_TOL_S, ((a, b), truth[group[-1]])  # ends at a phrase end
    for (_, b), (c, _) in zip(pieces, pieces[1:]):
        assert b <= c  # in order, not overlapping
    # 2 s pieces: no two phrases fit together; an edge is at a phrase's start or end, or a cut inside a phrase
    # that does not fit 2 s with its padding (0.16 s) and the VAD's edges (a margin of 0.14 s)
    short = _pieces(rec, talk_probs, 2.0)
    assert all(b - a <= 2.0 + 1e-9 for a, b in short) and len(short) > len(SCRIPT)
    too_long = [(s, e) for s, e in truth if e - s > 2.0 - 0.3]
    for a, b in short:
        assert min(abs(a - s) for s, _ in truth) <= EDGE_TOL_S or any(s < a < e for s, e in too_long)
        assert min(abs(b - e) for _, e in truth) <= EDGE_TOL_S or any(s < b < e for s, e in too_long)
    # the 30 s packing (max_segment_s None) is unchanged: one piece here, with the 200 ms padding
    packed = _pieces(rec, talk_probs, None)
    assert packed == vad.merge_regions(vad.regions_from_probabilities(talk_probs, len(rec)), probs=talk_probs)
    assert len(packed) == 1 and packed[0][0] == pytest.approx(truth[0][0] - 0.2, abs=EDGE_TOL_S)
    # speech-shaped with S = 30 still ends a piece at each pause of 1 s or more
    groups30 = _pieces(rec, talk_probs, 30.0)
    assert len(groups30) == 4 and all(abs(a - truth[i][0]) <= EDGE_TOL_S and abs(b - truth[j][1]) <= EDGE_TOL_S
                                      for (a, b), (i, j) in zip(groups30, ((0, 1), (2, 4), (5, 6), (7, 7))))


def test_long_unbroken_run_is_cut_into_the_fewest_pieces(run):
    rec, (s, e) = run
    regions = vad.speech_regions(rec, device="cpu", **{k: v for k, v in vad.segment_options(MAX_S).items()
                                                       if k in ("speech_pad_ms", "end_pad_ms")})
    assert len(regions) == 1 and regions[0][1] - regions[0][0] > 2 * MAX_S + 1.0, regions  # one unbroken run
    pieces = vad.segment(rec, device="cpu", **vad.segment_options(MAX_S))
    length = regions[0][1] - regions[0][0]
    assert len(pieces) == math.ceil(length / MAX_S)
    assert all(b - a <= MAX_S + 1e-9 and b - a >= length / (2 * len(pieces)) - 1e-9 for a, b in pieces)
    assert all(b == c for (_, b), (c, _) in zip(pieces, pieces[1:]))  # cut inside the run: contiguous
    assert abs(pieces[0][0] - s) <= EDGE_TOL_S and abs(pieces[-1][1] - e) <= EDGE_TOL_S
    # each cut at the quietest 32 ms window boundary among those that leave the rest room for its pieces, no
    # piece shorter than length / (2 k) (merge_regions' contract, follow_pauses step 1)
    probs = vad.speech_probabilities(rec, device="cpu")
    w, k, b, shortest = vad.WINDOW_S, len(pieces), pieces[-1][1], length / (2 * len(pieces))
    for n, (a, cut) in enumerate(pieces[:-1]):
        left = k - n - 1  # pieces after this one
        lo, hi = max(a + shortest, b - left * MAX_S), min(a + MAX_S, b - left * shortest)
        allowed = probs[math.ceil(lo / w - 1e-9): math.floor(hi / w + 1e-9) + 1]
        assert lo - 1e-9 <= cut <= hi + 1e-9 and probs[int(round(cut / w))] <= allowed.min() + 1e-5


def test_segments_carry_the_pieces_times(tiny_asr, talk, talk_probs):
    rec, _ = talk
    pieces = _pieces(rec, talk_probs, MAX_S)
    r = glmasr.transcribe(rec, model=tiny_asr, sampling_rate=SR, max_new_tokens=3, segmentation="vad",
                          max_segment_s=MAX_S)
    assert r.num_groups == len(pieces) == len(r.segments) and r.num_windows == len(pieces)
    for seg, (a, b) in zip(r.segments, pieces):  # one prompt per piece, with the piece's times
        assert seg.start == pytest.approx(a, abs=1 / SR) and seg.end == pytest.approx(b, abs=1 / SR)
        assert seg.end - seg.start <= MAX_S + 1e-6
    # each segment is what its stretch gives alone
    seg = r.segments[1]
    alone = glmasr.transcribe(rec[int(round(seg.start * SR)): int(round(seg.end * SR))], model=tiny_asr,
                              sampling_rate=SR, max_new_tokens=3)
    assert seg.token_ids == alone.token_ids
    last = list(glmasr.transcribe_stream(rec, model=tiny_asr, sampling_rate=SR, max_new_tokens=3,
                                         segmentation="vad", max_segment_s=MAX_S))[-1]
    assert [(s.start, s.end) for s in last.result.segments] == [(s.start, s.end) for s in r.segments]
    # max_segment_s None: the 30 s packing as before
    packed = glmasr.transcribe(rec, model=tiny_asr, sampling_rate=SR, max_new_tokens=3, segmentation="vad")
    expected = _pieces(rec, talk_probs, None)
    assert len(packed.segments) == len(expected)
    for seg, (a, b) in zip(packed.segments, expected):
        assert seg.start == pytest.approx(a, abs=1 / SR) and seg.end == pytest.approx(b, abs=1 / SR)
    # the default stays the reference's 30 s windows
    windows = glmasr.transcribe(rec, model=tiny_asr, sampling_rate=SR, max_new_tokens=3)
    assert windows.segments[0].start == 0.0 and windows.num_windows == math.ceil(len(rec) / (30 * SR))


def test_max_segment_s_errors(tiny_asr):
    audio = _noise(3 * SR, 4)
    with pytest.raises(ValueError, match=r"max_segment_s=7 .*segmentation='vad'"):
        glmasr.transcribe(audio, model=tiny_asr, sampling_rate=SR, max_segment_s=7)
    with pytest.raises(ValueError, match="max_segment_s"):
        glmasr.transcribe_stream(audio, model=tiny_asr, sampling_rate=SR, max_segment_s=7.0)
    with pytest.raises(ValueError, match="max_segment_s must be between"):
        glmasr.transcribe(audio, model=tiny_asr, sampling_rate=SR, segmentation="vad", max_segment_s=0.5)
    with pytest.raises(ValueError, match="max_segment_s must be a number"):
        vad.segment_options(31.0)


# -- the rule on given regions ----------------------------------------------------------------------------------------
def _cost(pieces):
    """(pieces, total 1 / (gap + 0.05) over the cuts): what the rule minimises, for the brute force."""
    cuts = [c - b for (_, b), (c, _) in zip(pieces, pieces[1:])]
    return len(pieces), sum(1.0 / (g + vad._CUT_SOFTEN_S) for g in cuts)


def _brute_force(regions, max_s, max_gap_s):
    """The best partition over all 2^(n-1) sets of cuts between consecutive regions."""
    best = None
    n = len(regions)
    for mask in itertools.product((False, True), repeat=n - 1):
        pieces, start = [], 0
        for i, cut in enumerate(mask + (True,)):
            if cut:
                pieces.append((regions[start][0], regions[i][1]))
                start = i + 1
        if any(b - a > max_s + 1e-9 for a, b in pieces):
            continue
        if max_gap_s is not None and any(not cut and regions[i + 1][0] - regions[i][1] > max_gap_s
                                         for i, cut in enumerate(mask)):
            continue
        cost = _cost(pieces)
        if best is None or cost < best[0]:
            best = (cost, pieces)
    return best[1]


def test_follow_pauses_is_the_best_partition_on_random_regions():
    rng = np.random.default_rng(20)
    for trial in range(300):
        n = int(rng.integers(1, 10))
        max_s = float(rng.choice([3.0, 5.0, 7.0]))
        lengths = rng.uniform(0.2, max_s, n)
        gaps = np.where(rng.random(n) < 0.15, 0.0, rng.uniform(0.05, 1.6, n))  # some regions touch
        regions, t = [], float(rng.uniform(0, 2))
        for length, gap in zip(lengths, gaps):
            regions.append((round(t, 6), round(t + float(length), 6)))
            t += float(length) + float(gap)
        regions = [r for r in regions if r[1] > r[0]]
        max_gap_s = None if trial % 3 == 0 else float(rng.uniform(0.3, 1.2))
        got = vad.merge_regions(regions, max_s=max_s, follow_pauses=True, max_gap_s=max_gap_s)
        # the brute force groups the same units (regions longer than max_s cut as step 1 cuts them)
        units = [u for a, b in vad._normalised(regions) for u in vad._cut_fewest(a, b, max_s, None)]
        assert got == _brute_force(units, max_s, max_gap_s), (regions, max_s, max_gap_s)
        if max_gap_s is None and len(units) == len(regions):  # the fewest pieces: as many as greedy packing makes
            assert len(got) == len(vad.merge_regions(regions, max_s=max_s))


def test_follow_pauses_cuts_at_the_longest_pauses():
    w = vad.WINDOW_S
    # five regions, pauses of 0.9, 0.4, 0.45 and 0.1 s; at most 4 s a piece, three pieces are needed and four
    # groupings of three fit: the cuts go at the 0.9 and 0.45 s pauses
    regions = [(0.0, 1.0), (1.9, 2.9), (3.3, 4.3), (4.75, 5.75), (5.85, 7.35)]
    assert vad.merge_regions(regions, max_s=4.0, follow_pauses=True) == [(0.0, 1.0), (1.9, 4.3), (4.75, 7.35)]
    # and a pause of more than max_gap_s always cuts, even where the piece would fit
    assert vad.merge_regions(regions, max_s=30.0, follow_pauses=True, max_gap_s=0.5) == [(0.0, 1.0), (1.9, 7.35)]
    assert vad.merge_regions(regions, max_s=30.0, follow_pauses=True) == [(0.0, 7.35)]
    # a region longer than max_s: the fewest pieces, cut at the dips that leave the rest room
    p = np.full(int(40 / w), 0.95, np.float32)
    for t, v in ((3.0, 0.05), (7.5, 0.2), (13.0, 0.01), (14.3, 0.3)):
        p[int(round(t / w))] = v
    pieces = vad.merge_regions([(1.0, 21.0)], max_s=7.0, probs=p, follow_pauses=True)
    # 20 s -> 3 pieces; the first cut must lie in [21 - 14, 1 + 7] = [7, 8] (the deeper dip at 3 s would leave
    # 18 s for two pieces): at 7.5; the second in [21 - 7, 7.5 + 7] (the dip at 13 s would leave 8 s): at 14.3
    assert [round(b, 3) for _, b in pieces] == [round(round(7.5 / w) * w, 3), round(round(14.3 / w) * w, 3), 21.0]
    # without probabilities: the latest allowed point
    assert vad.merge_regions([(1.0, 21.0)], max_s=7.0, follow_pauses=True) == [(1.0, 8.0), (8.0, 15.0),
                                                                              (15.0, 21.0)]
    # the old greedy packing is untouched by the new keyword's default
    assert vad.merge_regions([(0.0, 5.0), (20.0, 29.0), (31.0, 33.0)], max_s=30.0) == [(0.0, 29.0), (31.0, 33.0)]
    assert vad.merge_regions([(0.0, 5.0), (20.0, 29.0), (31.0, 33.0)], max_s=30.0, follow_pauses=True) == \
        [(0.0, 5.0), (20.0, 33.0)]  # speech-shaped: the cut at the 15 s pause
    assert vad.merge_regions([], follow_pauses=True) == []


def test_asymmetric_padding():
    w = vad.WINDOW_S
    q = np.zeros(300, np.float32)
    q[20:40] = 0.9
    q[60:80] = 0.9  # 20 windows (640 ms) apart: the 100 + 60 ms pads fit
    q[100:130] = 0.9
    q[135:160] = 0.9  # 5 windows (160 ms) after the one before: joined (shorter than min_silence)
    q[200:220] = 0.9
    got = vad.regions_from_probabilities(q, speech_pad_ms=100, end_pad_ms=60, min_silence_ms=300)
    ends = [39 * w, 79 * w, 159 * w, 219 * w]  # vad._END_LAG: one window before the first one below threshold
    starts = [20 * w, 60 * w, 100 * w, 200 * w]
    assert len(got) == 4
    for (a, b), s, e in zip(got, starts, ends):
        assert a == pytest.approx(s - 0.1, abs=1e-6) and b == pytest.approx(e + 0.06, abs=1e-6)
    # regions 288 ms apart with pads of 0.3 s before and 0.1 s after: the gap is shared 3:1
    r = np.zeros(200, np.float32)
    r[20:60] = 0.9
    r[68:108] = 0.9
    got = vad.regions_from_probabilities(r, speech_pad_ms=300, end_pad_ms=100, min_silence_ms=200)
    assert len(got) == 2
    gap = 68 * w - 59 * w
    assert got[0][1] == pytest.approx(59 * w + gap / 4, abs=1 / SR)
    assert got[1][0] == pytest.approx(got[0][1], abs=1 / SR)
    # end_pad_ms left out: the symmetric padding, exactly as before
    assert vad.regions_from_probabilities(r, speech_pad_ms=300, min_silence_ms=200) == \
        vad.regions_from_probabilities(r, speech_pad_ms=300, end_pad_ms=300, min_silence_ms=200)
    with pytest.raises(ValueError, match="end_pad_ms"):
        vad.regions_from_probabilities(r, end_pad_ms=-1)
