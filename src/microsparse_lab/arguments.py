"""Argument types shared by the commands: each rejects bad input with a message naming the fix."""

from __future__ import annotations

import argparse
import math

from microsparse.sparsifiers import validate_density


def whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number >= {minimum}, got {text!r}"
        ) from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return whole_number(text, 1)


def non_negative_int(text: str) -> int:
    return whole_number(text, 0)


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def density(text: str) -> float:
    try:
        return validate_density(number(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_float(text: str) -> float:
    value = number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def momentum(text: str) -> float:
    value = number(text)
    if not 0 <= value < 1:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text!r}")
    return value


def density_warmup(text: str) -> tuple[float, float]:
    """``START,EPOCHS``: a start density and the epochs it takes to decay to --density."""
    start, comma, epochs = text.partition(",")
    if not comma:
        raise argparse.ArgumentTypeError(f"expected START,EPOCHS (e.g. 0.01,0.5), got {text!r}")
    return density(start), positive_float(epochs)
