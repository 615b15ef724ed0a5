"""LocalAgreement-2 over token ids (Machacek et al., arXiv 2307.14743), as pure functions.

While a person speaks, the growing turn is re-transcribed every hop (a "draft"). A token prefix is *agreed* once
two consecutive drafts share it, cut back to a word boundary so that a word is never published half-way:

    agreed = longest common prefix of the last two drafts' token ids, shortened until the token after it starts a
             new word in both drafts; never shorter than what was agreed before (it only grows)

"Starts a new word" is decided on text, with the checkpoint's tokenizer (``decode``: ids -> text): the text the
draft has after the cut begins with whitespace or with a CJK character (Chinese and Japanese are written without
spaces: each character stands alone), and the text before the cut ends with a whole character (never with a
byte-level piece of one, which decodes to U+FFFD). Punctuation is not a word start: it stays with the word
before it.

The agreed text (``agreed_text``) is the decode of the agreed ids less any trailing incomplete character. The
final decode of the turn is forced to start with the agreed ids (``DecodeOptions.forced_prefix_ids``), so the
agreed text is a prefix of the final text and nothing published is ever retracted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a byte-level decode gives for an incomplete UTF-8 sequence

Decode = Callable[[list[int]], str]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def is_word_start(ch: str) -> bool:
    """``ch`` begins a new word: whitespace, or a character of a script written without spaces (CJK ideographs,
    kana, hangul)."""
    if ch.isspace():
        return True
    o = ord(ch)
    return (0x3040 <= o <= 0x30FF  # hiragana, katakana
            or 0x3400 <= o <= 0x4DBF or 0x4E00 <= o <= 0x9FFF or 0xF900 <= o <= 0xFAFF  # CJK ideographs
            or 0x20000 <= o <= 0x3FFFF  # CJK extensions B..
            or 0xAC00 <= o <= 0xD7AF)  # hangul syllables


def _ends_word(head: str, whole: str) -> bool:
    """``head`` (the text before a cut) ends a word of ``whole`` (the draft's text): it ends with a whole character
    and the text after it begins a new word."""
    return (bool(head) and not head.endswith(REPLACEMENT) and len(whole) > len(head) and whole.startswith(head)
            and is_word_start(whole[len(head)]))


def is_word_boundary(ids: Sequence[int], k: int, decode: Decode, whole: str | None = None) -> bool:
    """Cutting ``ids`` after its first ``k`` tokens ends a word: the text of the tokens after the cut begins a new
    word and the text before it ends with a whole character. False at the end of ``ids`` (nothing follows: the
    last word may still grow) and at 0. ``whole``: ``decode(ids)`` when the caller has it."""
    if k <= 0 or k >= len(ids):
        return False
    return _ends_word(decode(list(ids[:k])), decode(list(ids)) if whole is None else whole)


def agree(previous: Sequence[int], current: Sequence[int], agreed: Sequence[int], decode: Decode) -> list[int]:
    """LocalAgreement-2: the agreed ids after the draft ``current`` followed the draft ``previous``, given the ids
    ``agreed`` so far. The result starts with ``agreed`` and is never shorter; it is longer only when both drafts
    start with ``agreed`` and share a longer prefix that ends at a word boundary in both."""
    agreed = list(agreed)
    m = len(agreed)
    if list(previous[:m]) != agreed or list(current[:m]) != agreed:
        return agreed
    n = common_prefix(previous, current)
    if n <= m:
        return agreed
    whole_prev, whole_cur = decode(list(previous)), decode(list(current))
    for k in range(n, m, -1):  # the longest first; the prefix (so its text) is the same in both drafts
        head = decode(list(current[:k]))
        if _ends_word(head, whole_cur) and _ends_word(head, whole_prev):
            return list(current[:k])
    return agreed


def agreed_text(ids: Sequence[int], decode: Decode) -> str:
    """The text of agreed ids as it is published: their decode less trailing incomplete characters, less
    leading whitespace (a transcript is stripped) and less trailing whitespace (held back until text follows
    it, so the published text stays a prefix of the stripped final transcript)."""
    return decode(list(ids)).rstrip(REPLACEMENT).strip()
