"""What the commands share: the ``--model`` argument's resolution and the argparse types that refuse nonsensical
values when a flag is parsed (a count below 1, a negative duration, a port out of range)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Overrides (tests): the tiny-random checkpoint folder (default: the user cache, glmasr.checkpoint.resources.cache_dir())
# and the one local real-weights folder to look at (default: resources.local_weights_candidates()).
TINY_RANDOM: Path | None = None
LOCAL_WEIGHTS: Path | None = None


def pick_model(arg: str | None) -> str:
    """The --model argument -> what ``glmasr.load`` gets: ``tiny-random`` built now (saying so on stderr; a
    CheckpointError if the cache cannot be written), a given value as it is, by default the local weights folder
    if there is one, else the hub id."""
    from ..checkpoint import resources
    from ..checkpoint.weights import DEFAULT_MODEL_ID, TINY_RANDOM as TINY_NAME, tiny_random_checkpoint

    if arg == TINY_NAME:
        return str(tiny_random_checkpoint(TINY_RANDOM, log=lambda msg: print(msg, file=sys.stderr)))
    if arg is not None:
        return arg
    for folder in [LOCAL_WEIGHTS] if LOCAL_WEIGHTS is not None else resources.local_weights_candidates():
        if (folder / "config.json").exists():
            return str(folder)
    return DEFAULT_MODEL_ID


def positive_int(text: str) -> int:
    """argparse type of a count flag: an integer >= 1, else a message naming the value."""
    return int_at_least(1)(text)


def int_at_least(low: int):
    """argparse type: an integer >= ``low`` (flags refuse a nonsensical count when they are parsed, not later)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def int_between(low: int, high: int):
    """argparse type: an integer in ``low..high``."""

    def parse(text: str) -> int:
        value = int_at_least(low)(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value

    return parse


def seconds_between(low: float, high: float):
    """argparse type: a number of seconds in ``[low, high]``."""

    def parse(text: str) -> float:
        value = _finite_number(text, low, False, f"between {low:g} and {high:g} seconds")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g} seconds, got {text}")
        return value

    return parse


def _finite_number(text: str, minimum: float, strict: bool, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > minimum if strict else value >= minimum) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type of a duration flag: a finite number of seconds > 0."""
    return _finite_number(text, 0.0, True, "a positive number of seconds")


def non_negative_float(text: str) -> float:
    """argparse type of a limit flag where 0 means none: a number >= 0."""
    return _finite_number(text, 0.0, False, "a number >= 0")


def port(text: str) -> int:
    """argparse type of a TCP port: 0 (any free one) to 65535."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"a port is a whole number in 0..65535, got {text!r}")
    return int(text)
