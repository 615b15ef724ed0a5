"""From a segment's text to the token sequence an aligner forces, and from token times back to words.

Words: space-delimited scripts give one word per whitespace-separated run; CJK ideographs, kana and hangul one
word per character (``is_cjk``), also inside a run (``iPhone的价格`` -> ``iPhone``, ``的``, ``价``, ``格``).
Punctuation carries no sound: a piece made of punctuation or symbols only (``,`` ``。`` ``—`` ``”``) belongs to
the word before it (to the next one at the start of the text, and opening quotes and brackets always), so
``Hello, world.`` gives ``Hello,`` and ``world.``, and a word's text is always the original text from its first
to its last character (no surrounding whitespace; words of space-delimited scripts are joined by one space).

Alignment text: each word lowercased with punctuation and symbols removed (a letter's apostrophe inside a word
kept, as in ``don't``; other inner marks become a space, ``well-known`` -> ``well known``), words joined as they
were in the text (a space where the text had whitespace, nothing between CJK characters): the form the
glm-asr-ctc head was trained on (lowercase English, transcripts without punctuation). It is tokenized with the
model's own tokenizer in one piece, exactly as the training transcripts were, and each token is mapped to the
word(s) its characters belong to (the tokenizer's offsets). A token that spans two words (a multi-character CJK
token like ``你好``) joins them into one word: the token is the smallest thing with a time. A space-only token
belongs to the word after it. A word the tokenizer gave no token (it dropped its characters) joins the word
before it. Times are never invented, so no word is split below its tokens.
"""

from __future__ import annotations

import itertools
import re
import unicodedata
from dataclasses import dataclass

_CJK_RANGES = ((0x1100, 0x11FF), (0x3040, 0x30FF), (0x3130, 0x318F), (0x31F0, 0x31FF), (0x3400, 0x4DBF),
               (0x4E00, 0x9FFF), (0xA960, 0xA97F), (0xAC00, 0xD7AF), (0xD7B0, 0xD7FF), (0xF900, 0xFAFF),
               (0x20000, 0x3134F))
_APOSTROPHES = "'\u2019"


def is_cjk(ch: str) -> bool:
    """A character that is a word by itself: CJK ideographs, kana, hangul."""
    o = ord(ch)
    return any(a <= o <= b for a, b in _CJK_RANGES)


def _sounds(ch: str) -> bool:
    """Letters, digits and combining marks are spoken; punctuation, symbols, spaces and controls are not."""
    return unicodedata.category(ch)[0] in "LNM"


@dataclass
class Piece:
    """A candidate word: the original text [start, end) and its alignment form ('' for punctuation only)."""

    start: int
    end: int
    form: str
    space_before: bool  # whitespace separates it from the previous piece in the text


@dataclass
class WordPlan:
    """One segment's words and the tokens to align. ``words[j]`` = (start, end) in ``text``; token k belongs to
    word ``token_word[k]``; ``align_text`` is what was tokenized."""

    text: str
    words: list[tuple[int, int]]
    align_text: str
    token_ids: list[int]
    token_word: list[int]

    def word_text(self, j: int) -> str:
        a, b = self.words[j]
        return self.text[a:b]


def _opening(chunk: str) -> bool:
    """Opening quotes and brackets (“ ( 「): they belong to the word after them."""
    return all(unicodedata.category(ch) in ("Ps", "Pi") for ch in chunk)


def _form(chunk: str) -> str:
    out = []
    for i, ch in enumerate(chunk):
        if _sounds(ch):
            out.append(ch.lower())
        elif ch in _APOSTROPHES and 0 < i < len(chunk) - 1 and chunk[i - 1].isalpha() and chunk[i + 1].isalpha():
            out.append("'")
        else:
            out.append(" ")
    return " ".join("".join(out).split())


def split_pieces(text: str) -> list[Piece]:
    """Whitespace-separated runs, split further at CJK characters (each its own piece)."""
    pieces = []
    for m in re.finditer(r"\S+", text):
        run, base = m.group(), m.start()
        first = True
        i = 0
        while i < len(run):
            if is_cjk(run[i]):
                j = i + 1
            elif i and not _sounds(run[i]):  # punctuation right after a CJK character: a piece of its own
                j = i
                while j < len(run) and not is_cjk(run[j]) and not _sounds(run[j]):
                    j += 1
            else:
                j = i
                while j < len(run) and not is_cjk(run[j]):
                    j += 1
            pieces.append(Piece(base + i, base + j, _form(run[i:j]), first and bool(pieces)))
            first = False
            i = j
    return pieces


def _merge(pieces: list[Piece], link: list[bool]) -> list[list[int]]:
    """Groups of consecutive pieces; ``link[i]``: piece i and i+1 are one word."""
    groups: list[list[int]] = []
    for i in range(len(pieces)):
        if i and link[i - 1]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def plan_words(text: str, encode) -> WordPlan:
    """The words of ``text`` and the tokens to align (see the module docstring). ``encode(s)`` -> (ids,
    offsets): the model tokenizer's ids for ``s`` without special tokens and each id's character span in ``s``."""
    pieces = split_pieces(text)
    if not pieces:
        return WordPlan(text, [], "", [], [])
    # punctuation-only pieces join the piece before them (the next one when none is before)
    link = [False] * max(0, len(pieces) - 1)
    spoken = [i for i, p in enumerate(pieces) if p.form]
    if not spoken:  # nothing to say: one word, no tokens, no time
        return WordPlan(text, [(pieces[0].start, pieces[-1].end)], "", [], [])
    for i, p in enumerate(pieces):
        if not p.form:
            if i < spoken[0] or (i < spoken[-1] and _opening(text[p.start:p.end])):
                link[i] = True
            else:
                link[i - 1] = True
    # the alignment text, and which piece each of its characters belongs to (-1: a separator)
    chars: list[str] = []
    owner: list[int] = []
    prev = -1
    for i in spoken:
        if chars and any(pieces[k].space_before for k in range(prev + 1, i + 1)):
            chars.append(" ")
            owner.append(-1)
        for ch in pieces[i].form:
            chars.append(ch)
            owner.append(-1 if ch == " " else i)
        prev = i
    align_text = "".join(chars)
    ids, offsets = encode(align_text)
    if len(ids) != len(offsets):
        raise ValueError(f"the tokenizer gave {len(ids)} ids but {len(offsets)} offsets")
    token_piece: list[int | None] = []
    for a, b in offsets:
        owners = sorted({owner[c] for c in range(max(0, a), min(b, len(owner))) if owner[c] >= 0})
        token_piece.append(owners[0] if owners else None)
        for x, y in itertools.pairwise(owners):  # a token across pieces: they are one word
            for k in range(x, y):
                link[k] = True
    # space-only tokens belong to the next token's piece (the last one's to the one before)
    after = None
    for k in range(len(token_piece) - 1, -1, -1):
        if token_piece[k] is None:
            token_piece[k] = after
        else:
            after = token_piece[k]
    before = None
    for k in range(len(token_piece)):
        if token_piece[k] is None:
            token_piece[k] = before
        before = token_piece[k]
    groups = _merge(pieces, link)
    # a word without a token (the tokenizer dropped its characters) joins the word before it (after it, first)
    has_token = {p for p in token_piece if p is not None}
    merged: list[list[int]] = []
    carry: list[int] = []
    for g in groups:
        if any(i in has_token for i in g):
            merged.append(carry + g)
            carry = []
        elif merged:
            merged[-1].extend(g)
        else:
            carry.extend(g)
    if carry:  # no token at all
        merged.append(carry)
    group_of = {i: j for j, members in enumerate(merged) for i in members}
    words = [(pieces[g[0]].start, pieces[g[-1]].end) for g in merged]
    token_word = [group_of[p] for p in token_piece if p is not None]
    if len(token_word) != len(ids):  # only when no token has a piece: nothing to align
        return WordPlan(text, words, align_text, [], [])
    return WordPlan(text, words, align_text, [int(t) for t in ids], token_word)
