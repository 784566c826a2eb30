"""Exceptions raised by microsparse, each naming what went wrong and how to fix it."""

from __future__ import annotations


class ConfigMismatchError(RuntimeError):
    """Ranks of one process group disagree on something that must be identical.

    Raised on *every* rank (the disagreement is detected through a collective that all ranks
    take part in), so a misconfigured job stops with a message instead of deadlocking.
    """


class NonFiniteGradientError(FloatingPointError):
    """A gradient contained NaN or Inf at a synchronisation step.

    Raised on every rank of the group in the same step. Sending such a gradient would
    spread it into every worker's parameters and, through error feedback, keep it in the
    residual forever, so microsparse stops instead. The reducer's residual is not usable
    after this error: restore it from a checkpoint (``load_state_dict``) or build a new one.
    """
