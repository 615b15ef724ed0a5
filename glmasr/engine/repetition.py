"""The runaway-text guard: a sequence stuck repeating the same n-gram is ended (finish_reason "repetition").

``is_stuck(tokens, repeats)``: the tokens end in ``repeats`` or more back-to-back copies of one n-gram
(1 <= n <= MAX_NGRAM) that together span at least MIN_SPAN tokens. The span bound keeps short genuine
repetition ("no, no, no") alive. The engine checks it on the host after each read-back, for the sequences that
ask for it, and stops them there: the tokens already produced (the loop's copies up to that read-back) stay.
"""

from __future__ import annotations

MAX_NGRAM = 32
MIN_SPAN = 16


def check_repetition_stop(repeats) -> None:
    if repeats is not None and (isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2):
        raise ValueError(f"repetition_stop must be an integer >= 2 (copies of an n-gram in a row), got {repeats!r}")


def is_stuck(tokens: list[int], repeats: int | None) -> bool:
    if not repeats:
        return False
    end = len(tokens)
    for n in range(1, MAX_NGRAM + 1):
        need = max(repeats, -(-MIN_SPAN // n))  # copies needed for this n-gram length
        if need * n > end:
            break
        gram = tokens[end - n:]
        if all(tokens[end - (c + 1) * n: end - c * n] == gram for c in range(1, need)):
            return True
    return False
