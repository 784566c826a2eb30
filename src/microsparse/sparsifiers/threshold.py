"""MiCRO's threshold controller: one scalar, identical on every rank, corrected every step.

The controller sees only the previous step's global selected count K (which every rank knows
after the exchange), so all ranks compute bit-identical thresholds without communicating.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

ThresholdRule = Literal["quantile", "symmetric", "as_coded"]
THRESHOLD_RULES: tuple[str, ...] = ("quantile", "symmetric", "as_coded")
"""``quantile`` estimates λ from the current step (:class:`QuantileThreshold`); ``symmetric`` and
``as_coded`` are the reference's ±0.5 %-per-step corrections (:class:`ThresholdController`)."""
STEP_RULES: tuple[str, ...] = ("symmetric", "as_coded")

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
        if rule not in STEP_RULES:
            raise ValueError(f"threshold_rule must be one of {', '.join(STEP_RULES)}; got {rule!r}")
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


class QuantileThreshold:
    """λ from this step's own data: the global (1 − k/d) quantile of |a|, from a histogram.

    Every rank bins the log2 magnitudes of the partition it owns into ``bins`` bins spanning
    ``octaves`` octaves each way around the last threshold (one pass over d/n entries); the
    ranks sum their histograms (one all-reduce of a few hundred integers); and every rank
    solves the same integer histogram for the λ at which the global count is k, interpolating
    inside the bin as a power-law tail. Because the partitions cover the vector exactly once,
    the summed histogram counts the whole vector. The estimate uses only the current step's
    data, so error feedback cannot feed it an oscillation (a big step emptying the residual,
    then a small one, ...), and λ can move by up to 2**octaves in one step.

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> magnitudes = torch.empty(100_000).exponential_()  # a tail like a gradient's
        >>> estimator = QuantileThreshold(target=100)
        >>> estimator.threshold = 5.0  # the last step's λ: the histogram spans 5/8 .. 5·8
        >>> estimator.solve(estimator.histogram([magnitudes], torch.empty(100_000)))
        >>> round(estimator.threshold, 2), int((magnitudes >= estimator.threshold).sum())
        (6.87, 100)
    """

    def __init__(self, target: int, bins: int = 256, octaves: float = 3.0) -> None:
        self.target = target
        self.bins = bins
        self.octaves = octaves
        self.threshold = initial_threshold(target)

    def _range(self) -> tuple[float, float]:
        centre = math.log2(self.threshold)
        return centre - self.octaves, centre + self.octaves

    def histogram(self, magnitudes: list[torch.Tensor], scratch: torch.Tensor) -> torch.Tensor:
        """Counts of log2|a| per bin (int64), lowest bin holding everything below the range.

        ``scratch`` (at least as long as all ``magnitudes`` together) receives the logarithms.
        """
        low, high = self._range()
        total = torch.zeros(self.bins, dtype=torch.long, device=scratch.device)
        offset = 0
        for values in magnitudes:
            logs = torch.log2(values, out=scratch[offset : offset + values.numel()].view_as(values))
            offset += values.numel()
            total += torch.histc(logs.clamp_(low, high), bins=self.bins, min=low, max=high).long()
        return total

    def _above(self, histogram: torch.Tensor) -> list[int]:
        """above[j]: entries with log2|a| >= low + j·width (above[0] counts everything)."""
        counts = histogram.tolist()
        above = [0] * (self.bins + 1)
        for j in range(self.bins - 1, -1, -1):
            above[j] = above[j + 1] + counts[j]
        return above

    def solve(self, histogram: torch.Tensor) -> None:
        """Set ``threshold`` from the histogram summed over all ranks (identical on each)."""
        low, high = self._range()
        width = (high - low) / self.bins
        above = self._above(histogram)
        k = self.target
        if above[self.bins - 1] >= k:  # even the top bin holds k: rise as far as allowed
            self.threshold = 2.0 ** (high - width)
            return
        if above[1] < k:  # fewer than k above the range's bottom: fall as far as allowed
            self.threshold = 2.0**low
            return
        j = max(i for i in range(1, self.bins) if above[i] >= k)
        upper, lower = above[j], above[j + 1]
        # A power-law tail is a straight line in log(count) against log|a|.
        if lower > 0:
            fraction = math.log(upper / k) / math.log(upper / lower)
        else:
            fraction = (upper - k) / upper
        self.threshold = 2.0 ** (low + (j + fraction) * width)

    def state_dict(self) -> dict[str, float]:
        return {"threshold": self.threshold}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.threshold = float(state["threshold"])
