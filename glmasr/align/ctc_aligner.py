"""``CtcAligner``: word times from the glm-asr-ctc head over our own encoder's states, by CTC forced alignment.

Per segment (``AlignSegment``: its samples, start and text), in the caller's thread once its transcript is final:

1. Text: ``words.plan_words`` -> the words, the lowercased unpunctuated alignment text and its token ids (the
   model's own tokenizer, from the checkpoint folder's tokenizer.json).
2. Audio: the segment's samples in windows of at most 30 s (a segment of the "windows" segmentation spans
   consecutive 30 s windows; a "vad" segment is one window), each encoded *unpadded*: Whisper log-mel of the
   window (``audio.features`` on the zero-padded 30 s window, cut to the frames that hold audio: only the last
   frame or two differ from the log-mel of the bare clip) -> ``model.encode_states`` (the encoder's
   final-normed states before the projector, 50 per second). The head was trained on such unpadded states; the
   engine's own states come from windows zero-padded to 30 s, which shifts them (the head's authors measured a
   relative L2 of 0.24-0.49 between the two), so they are not reused. Windows of any lengths are encoded
   ``ENCODE_BATCH`` at a time, each masked to its own length (``encode_states(features, frames)``).
3. Head: log-softmax over the head's classes per window, kept for the segment's tokens and blank, windows
   concatenated in time.
4. The CTC Viterbi over all segments at once (on CUDA ``ctc.ctc_viterbi_batch_torch``: one Triton launch,
   ``glmasr_kernels.ctc_viterbi``; on the CPU ``ctc.ctc_viterbi_batch``, numpy); token i covers frames [a, b):
   times ``start_s + a * 0.02`` to ``start_s + b * 0.02``; a word spans its tokens; its probability is the mean
   posterior over its frames.
5. ``bias_correction`` (default on; ``aligner.bias_correction = False`` turns it off): the authors measured
   this head's word starts 105 ms late and ends 100 ms early against Montreal Forced Aligner on LibriSpeech
   (medians; English read speech; their figures, not measured here). Starts are moved 105 ms earlier and ends
   100 ms later (config.json ``start_bias_s`` / ``end_bias_s`` override the figures), then clamped to the segment
   and so that a word ends no later than the next one starts.

Cost: one more encoder pass over the audio (unpadded, so a little less than the engine's) plus the head
(~40 M parameters, ~5 % of the encoder's FLOPs per frame) and the Viterbi (T x 2L states; one pass over the
frames for the whole batch, one Triton launch on CUDA, numpy on the CPU). Thread-safety:
any number of threads may call ``align`` while the engine thread runs the model (the modules are read-only in
inference mode). On CUDA the work runs on the aligner's own stream, so it neither waits for nor is captured into
the engine's graphs; the two share the GPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..audio.features import (
    FRAMES_PER_WINDOW,
    HOP_LENGTH,
    WINDOW_SAMPLES,
    log_mel_windows,
)
from ..checkpoint.weights import hub_snapshot, looks_like_hub_id
from ..errors import CheckpointError
from ..results import Word
from .base import Aligner, AlignSegment
from .ctc import ctc_viterbi_batch, ctc_viterbi_batch_torch
from .head import CtcHead, load_head
from .words import WordPlan, plan_words

DEFAULT_ALIGNER_ID = "JazerJu/glm-asr-ctc"
ENCODE_BATCH = 8  # windows per encoder call (of mixed lengths: encode_states masks each to its own)


class TokenizerOffsets:
    """The model's tokenizer as ``encode(text) -> (ids, offsets)`` (no special tokens; offsets in characters):
    tokenizer.json through the ``tokenizers`` library when that file is all there is to the tokenizer (the same
    rule as ``checkpoint.tokenizer``), else transformers' fast tokenizer of the folder."""

    def __init__(self, folder: str | os.PathLike):
        from ..checkpoint.tokenizer import TokenizersAdapter

        folder = Path(folder)
        self._lock = threading.Lock()
        self._fast = None
        self._tok = None
        if TokenizersAdapter.from_folder(folder) is not None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
            self.size = self._tok.get_vocab_size(with_added_tokens=True)
            return
        try:
            from transformers import AutoTokenizer

            self._fast = AutoTokenizer.from_pretrained(str(folder))
        except Exception as e:
            raise CheckpointError(f"cannot load the tokenizer of {folder} for the aligner ({type(e).__name__}: "
                                  f"{e})") from None
        if not getattr(self._fast, "is_fast", False):
            raise CheckpointError(f"the tokenizer of {folder} gives no character offsets (not a fast tokenizer); "
                                  f"the aligner needs them to map tokens to words")
        self.size = len(self._fast)

    def __call__(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        with self._lock:  # transformers' tokenizer objects are not documented as thread-safe
            if self._tok is not None:
                enc = self._tok.encode(text, add_special_tokens=False)
                return list(enc.ids), list(enc.offsets)
            enc = self._fast(text, add_special_tokens=False, return_offsets_mapping=True)
            return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]



def resolve_head_folder(spec: str | os.PathLike) -> Path:
    """A local head folder, or a hub id fetched with ``huggingface_hub.snapshot_download`` (the cached copy
    first, then the network); CheckpointError saying where to put the folder when neither works."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    text = str(spec)
    if path.exists():
        raise CheckpointError(f"aligner {text!r} is a file; pass the folder that holds config.json and "
                              f"ctc_head.safetensors")
    if not looks_like_hub_id(text):
        raise CheckpointError(f"aligner {text!r} is neither an existing folder nor a Hugging Face hub id "
                              f"('owner/name', e.g. {DEFAULT_ALIGNER_ID})")
    try:
        return hub_snapshot(text, ["*.json", "*.safetensors", "*.md"])
    except Exception as e:  # offline, no such repo, gated: the same advice
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(
            f"could not get the aligner {text!r} from the Hugging Face hub ({type(e).__name__}: {first}).\n"
            f"No network here? Download the head where there is one and bring the folder:\n"
            f"  hf download {text} --local-dir weights/glm-asr-ctc\n"
            f"then pass it: glmasr.load(model, aligner='weights/glm-asr-ctc') or --aligner weights/glm-asr-ctc "
            f"(the folder holds config.json and ctc_head.safetensors)") from None


class CtcAligner(Aligner):
    """The glm-asr-ctc head as an ``Aligner`` (see the module docstring). Build with ``from_folder``; ``bind``
    it to the loaded model before ``align``."""

    name = "glm-asr-ctc"

    def __init__(self, head: CtcHead, tokenizer, bias_correction: bool = True, source: str = ""):
        if not isinstance(bias_correction, bool):
            raise TypeError(f"bias_correction must be True or False, got {bias_correction!r}")
        self.head = head
        self.config = head.config
        self.tokenizer = tokenizer
        self.bias_correction = bias_correction
        self.source = source
        self.model = None
        self._stream = None
        size = getattr(tokenizer, "size", None)
        if size is not None and size > self.config.vocab_size:
            raise CheckpointError(f"aligner head {source}: {self.config.vocab_size} classes (vocab_size) cannot cover "
                                  f"the model's tokenizer of {size} tokens: this head belongs to another tokenizer")

    @classmethod
    def from_folder(cls, spec: str | os.PathLike, model_folder: str | os.PathLike, device="cpu",
                    bias_correction: bool = True, model_config=None) -> CtcAligner:
        """The head in ``spec`` (folder or hub id) on ``device`` with the tokenizer of the model checkpoint in
        ``model_folder``; CheckpointError naming the problem (also a head whose input width is not
        ``model_config``'s encoder width, when given)."""
        folder = resolve_head_folder(spec)
        head = load_head(folder, device)
        aligner = cls(head, TokenizerOffsets(model_folder), bias_correction, source=str(folder))
        if model_config is not None:
            aligner._check_width(model_config.audio.hidden_size)
        return aligner

    def __repr__(self) -> str:
        return f"CtcAligner({self.source!r}, bias_correction={self.bias_correction})"

    def _check_width(self, width: int) -> None:
        if width != self.config.encoder_dim:
            raise CheckpointError(f"aligner head {self.source} takes encoder states {self.config.encoder_dim} wide "
                                  f"(encoder_dim), but this model's encoder gives {width}: the head was made for "
                                  f"another model")

    def bind(self, model) -> None:
        self._check_width(model.cfg.audio.hidden_size)
        if not hasattr(model, "encode_states"):
            raise TypeError(f"{type(model).__name__} has no encode_states (models.interface.AsrModel)")
        self.model = model
        dev = model.device
        param = next(self.head.parameters(), None)
        if param is not None and param.device != dev:
            self.head = self.head.to(dev)
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    # ---- the work ----
    def align(self, segments: Sequence[AlignSegment]) -> list[list[Word]]:
        if self.model is None:
            raise RuntimeError("CtcAligner.align before bind(model)")
        plans = [plan_words(s.text, self.tokenizer) for s in segments]
        for p in plans:
            bad = [t for t in p.token_ids if t >= self.config.vocab_size or t == self.config.blank_id]
            if bad:
                raise ValueError(f"token ids {bad[:5]} of the text {p.align_text[:40]!r} are outside the aligner "
                                 f"head's classes (vocab_size {self.config.vocab_size}, blank "
                                 f"{self.config.blank_id}): the head does not match this model's tokenizer")
        todo = [i for i, p in enumerate(plans) if p.token_ids and segments[i].samples.shape[0] >= 2 * HOP_LENGTH]
        out: list[list[Word]] = [[] for _ in segments]
        if not todo:
            return out
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), ctx:
            items = self._log_probs([segments[i] for i in todo], [plans[i] for i in todo])
            if self.model.device.type == "cuda":  # where the posteriors are: one kernel launch for the batch
                alignments = ctc_viterbi_batch_torch(items, blank=0)
            else:
                alignments = ctc_viterbi_batch([(lp.numpy(), tg) for lp, tg in items], blank=0)
        for i, aln in zip(todo, alignments):
            if aln is not None:
                out[i] = self._words(segments[i], plans[i], aln)
        return out

    def _log_probs(self, segments: list[AlignSegment], plans: list[WordPlan]):
        """Per segment: (log-posteriors (T, K) fp32 on the model's device with blank in column 0, targets as
        column indices)."""
        dev = self.model.device
        windows = []  # (segment, samples) in order
        for k, s in enumerate(segments):
            x = np.asarray(s.samples, dtype=np.float32)
            for a in range(0, x.shape[0], WINDOW_SAMPLES):
                w = x[a:a + WINDOW_SAMPLES]
                if w.shape[0] >= 2 * HOP_LENGTH:  # at least one encoder frame
                    windows.append((k, w))
        states = self._encode([w for _, w in windows], dev)
        per_segment: list[list[torch.Tensor]] = [[] for _ in segments]
        classes = []
        for p in plans:
            uniq = sorted(set(p.token_ids))
            classes.append((torch.tensor([self.config.blank_id] + uniq, dtype=torch.int64, device=dev),
                            {t: j + 1 for j, t in enumerate(uniq)}))
        for (k, _), st in zip(windows, states):
            per_segment[k].append(self.head.token_log_probs(st, classes[k][0]))
        items = []
        for k, p in enumerate(plans):
            lp = (torch.cat(per_segment[k]) if per_segment[k]
                  else torch.zeros((0, 1), dtype=torch.float32, device=dev))
            items.append((lp, [classes[k][1][t] for t in p.token_ids]))
        return items

    def _encode(self, windows: list[np.ndarray], dev) -> list[torch.Tensor]:
        """Encoder states (T_i, hidden) of each window (at most 30 s each), as if unpadded: windows sorted by
        length, ENCODE_BATCH per call, each call padded to its longest window with the others' own lengths
        given to ``encode_states`` (``frames``), which computes each as if alone."""
        out: list[torch.Tensor | None] = [None] * len(windows)
        order = sorted(range(len(windows)), key=lambda i: windows[i].shape[0])
        n_mels = self.model.cfg.audio.num_mel_bins
        for c in range(0, len(order), ENCODE_BATCH):
            chunk = order[c:c + ENCODE_BATCH]
            frames = [min(FRAMES_PER_WINDOW, windows[i].shape[0] // HOP_LENGTH) for i in chunk]
            batch = torch.zeros(len(chunk), WINDOW_SAMPLES, dtype=torch.float32)
            for j, i in enumerate(chunk):
                batch[j, :windows[i].shape[0]] = torch.from_numpy(windows[i])
            feats = log_mel_windows(batch.to(dev), n_mels)[:, :, :max(frames)]
            if min(frames) == max(frames):
                states = self.model.encode_states(feats)
            else:
                states = self.model.encode_states(feats, frames)
            for j, i in enumerate(chunk):
                out[i] = states[j, :(frames[j] + 1) // 2]
        return out

    def _words(self, seg: AlignSegment, plan: WordPlan, aln) -> list[Word]:
        cfg = self.config
        shift = cfg.frame_shift_s
        n_words = len(plan.words)
        tw = np.asarray(plan.token_word)
        frames = (aln.spans[:, 1] - aln.spans[:, 0]).astype(np.float64)
        first = np.full(n_words, np.iinfo(np.int64).max)
        last = np.full(n_words, -1)
        np.minimum.at(first, tw, aln.spans[:, 0])
        np.maximum.at(last, tw, aln.spans[:, 1])
        mass = np.bincount(tw, weights=aln.probs * frames, minlength=n_words)
        count = np.bincount(tw, weights=frames, minlength=n_words)
        lo, hi = seg.start_s, seg.start_s + seg.duration_s
        starts = seg.start_s + first * shift
        ends = seg.start_s + last * shift
        if self.bias_correction:
            starts = starts - cfg.start_bias_s
            ends = ends - cfg.end_bias_s
        starts = np.clip(starts, lo, hi)
        ends = np.clip(ends, lo, hi)
        ends[:-1] = np.minimum(ends[:-1], starts[1:])  # corrected ends may reach past the next start
        ends = np.maximum(ends, starts)
        return [Word(plan.word_text(j), float(starts[j]), float(ends[j]),
                     round(float(mass[j] / count[j]), 4) if count[j] else 0.0) for j in range(n_words)]
