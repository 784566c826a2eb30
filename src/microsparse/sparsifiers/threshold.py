"""MiCRO's threshold controller: one scalar, identical on every rank, corrected every step.

The controller sees only the previous step's global selected count K (which every rank knows
after the exchange), so all ranks compute bit-identical thresholds without communicating.
"""

from __future__ import annotations

import math
from typing import Literal

ThresholdRule = Literal["symmetric", "as_coded"]
THRESHOLD_RULES: tuple[str, ...] = ("symmetric", "as_coded")

# Multiplicative corrections of the reference code, by band of e = K / k.
_RAISE_FAST, _RAISE_SLOW, _LOWER_SLOW, _LOWER_FAST = 1.005, 1.00125, 0.9987, 0.995
_UPPER_BAND, _LOWER_BAND = 1.1, 0.909


def initial_threshold(target: int) -> float:
    """Hard-threshold starting value λ_0 = 1 / (2·sqrt(k)).

    Example:
        >>> initial_threshold(100)
        0.05
    """
    return 1.0 / (2.0 * math.sqrt(target))


def threshold_factor(ratio: float, rule: ThresholdRule) -> float:
    """Multiplicative correction of λ for e = K_{t-1} / k.

    ``"as_coded"`` reproduces the reference code, whose in-band test is written so that the
    0.9987 branch never runs: inside the band λ always rises by 0.125 %, which biases the
    actual density about 5 % below target. ``"symmetric"`` is the intended rule.

    Example:
        >>> threshold_factor(1.0, "as_coded"), threshold_factor(1.0, "symmetric")
        (1.00125, 0.9987)
    """
    if ratio > _UPPER_BAND:
        return _RAISE_FAST
    if ratio > _LOWER_BAND:
        if rule == "as_coded" or ratio > 1.0:
            return _RAISE_SLOW
        return _LOWER_SLOW
    return _LOWER_FAST


class ThresholdController:
    """Keeps the global selected count K near the target k by scaling λ every step.

    Example:
        >>> controller = ThresholdController(target=100, rule="symmetric")
        >>> controller.threshold
        0.05
        >>> controller.update(selected=500)  # sent 5x too much: raise λ by 0.5 %
        >>> round(controller.threshold, 6)
        0.05025
    """

    def __init__(self, target: int, rule: ThresholdRule = "symmetric") -> None:
        if rule not in THRESHOLD_RULES:
            raise ValueError(
                f"threshold_rule must be one of {', '.join(THRESHOLD_RULES)}; got {rule!r}"
            )
        if target < 1:
            raise ValueError(f"target must be >= 1, got {target}")
        self.target = target
        self.rule: ThresholdRule = rule
        self.threshold = initial_threshold(target)

    def update(self, selected: int) -> None:
        """Correct λ after a step that selected ``selected`` positions in total."""
        self.threshold *= threshold_factor(selected / self.target, self.rule)

    def state_dict(self) -> dict[str, float]:
        return {"threshold": self.threshold}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.threshold = float(state["threshold"])
