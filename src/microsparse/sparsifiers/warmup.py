"""A density warm-up: more entries sent in the first steps, decaying exponentially to δ.

Deep Gradient Compression starts sparse training at a higher density and lowers it over the
first epochs, so that the residuals of the early, fast-changing gradients do not pile up.
Every extra entry is real traffic: the run's mean density (``summary.json``'s
``mean_density``) counts the warm-up, and on a short run a warm-up that stays within a
budget (e.g. 1.1·δ on average) can only be a few dozen steps long
(:meth:`DensityWarmup.mean_density` says how much a schedule costs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from microsparse.sparsifiers.base import validate_density


@dataclass(frozen=True)
class DensityWarmup:
    """Density ``start · (δ / start) ** (t / steps)`` at step t < ``steps``, then δ.

    Example:
        >>> warmup = DensityWarmup(start=0.01, steps=4)
        >>> [round(warmup.density(t, 0.001), 5) for t in range(6)]
        [0.01, 0.00562, 0.00316, 0.00178, 0.001, 0.001]
        >>> round(warmup.mean_density(0.001, total_steps=620) / 0.001, 3)  # 2.7 % more entries
        1.027
    """

    start: float
    steps: int

    def __post_init__(self) -> None:
        try:
            validate_density(self.start)
        except (TypeError, ValueError):
            raise ValueError(
                f"density_warmup: the start density must be in (0, 1], got {self.start!r}"
            ) from None
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(
                f"density_warmup: the steps must be a whole number >= 1, got {self.steps!r}"
            )

    @classmethod
    def of(cls, value: DensityWarmup | tuple[float, int] | None) -> DensityWarmup | None:
        """A ``(start, steps)`` pair (or a DensityWarmup, or None) as a schedule."""
        if value is None or isinstance(value, DensityWarmup):
            return value
        try:
            start, steps = value
        except (TypeError, ValueError):
            raise ValueError(
                f"density_warmup must be a pair (start density, steps), e.g. (0.01, 50); "
                f"got {value!r}"
            ) from None
        return cls(start, steps)

    def check(self, density: float) -> None:
        """Raise unless the warm-up starts above the final density."""
        if self.start <= density:
            raise ValueError(
                f"density_warmup: the start density ({self.start:g}) must be above the density "
                f"({density:g}), which it decays to"
            )

    def density(self, step: int, density: float) -> float:
        """The density of ``step`` for a final density ``density``."""
        if step >= self.steps:
            return density
        return self.start * (density / self.start) ** (step / self.steps)

    def target(self, step: int, density: float, final_target: int, numel: int) -> int:
        """k at ``step``: ⌊density(step) · d⌋, never below the final k."""
        if step >= self.steps:
            return final_target
        return max(final_target, math.floor(self.density(step, density) * numel))

    def mean_density(self, density: float, total_steps: int) -> float:
        """The mean density of a run of ``total_steps`` steps under this schedule."""
        steps = range(total_steps)
        return math.fsum(self.density(t, density) for t in steps) / max(1, total_steps)
