"""Exceptions raised by microsparse, each naming what went wrong and how to fix it."""

from __future__ import annotations


class ConfigMismatchError(RuntimeError):
    """Ranks of one process group disagree on something that must be identical.

    Raised on *every* rank (the disagreement is detected through a collective that all ranks
    take part in), so a misconfigured job stops with a message instead of deadlocking.
    """


class NonFiniteGradientError(FloatingPointError):
    """A gradient contained NaN or Inf at a synchronisation step (with ``nonfinite="raise"``).

    Raised on every rank of the group in the same step, before anything changed: every
    residual, the sparsifier's state and the step counter are as they were before the call, so
    the caller may skip the batch and go on. (By default, ``nonfinite="skip"``, such a step is
    skipped on every rank instead, without the host waiting for the device.)
    """
