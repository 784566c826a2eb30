"""SAGE: a per-worker threshold rescaled every step by three heuristic factors α·β·γ."""

from __future__ import annotations

import math
from typing import Any

import torch

from microsparse.comm.framing import Framing, Padded
from microsparse.layout import Layout
from microsparse.sparsifiers.base import Magnitudes, Sparsifier
from microsparse.sparsifiers.registry import register_sparsifier
from microsparse.sparsifiers.threshold import initial_threshold


def slovin_sample_size(numel: int, margin: float = 0.05) -> int:
    """Slovin's sample size d / (1 + d·e²), as the reference code sizes SAGE's sample.

    Example:
        >>> slovin_sample_size(11_173_962), slovin_sample_size(100)
        (399, 80)
    """
    return max(1, int(numel / (1 + numel * margin * margin)))


@register_sparsifier
class Sage(Sparsifier):
    """SAGE as in the MiCRO authors' reference code (docs/METHOD.md, "Baselines").

    Each rank keeps its own threshold λ, starting at 1/(2·sqrt(k)). From the second step on,
    before selecting, it rescales λ by

    - α = s_t / s_{t-1}, the ratio of the mean |a| over ``sample_size`` random positions now
      and at the previous step (the positions are drawn afresh every step, in one gather);
    - β = 2 / (1 + exp(δ − δ_e)), where δ_e is the density that λ·α would select now (an
      extra pass over all d entries);
    - γ = 0.95 if δ_e < δ/10, 1.05 if δ_e > 10·δ, else 1;

    then sends every entry with |a| >= λ. Ranks select independently, so the union adds
    build-up on top of the threshold's own error. ``StepStats.threshold`` is this rank's λ.

    Args:
        sample_size: random positions per step; default Slovin's formula (399 for large d).
        seed: rank r draws its positions from a generator seeded with ``seed·n + r``.

    Example:
        >>> reducer = GradientReducer(params, "sage", density=0.001, seed=1)  # doctest: +SKIP
    """

    name = "sage"
    framing_class = Padded

    def __init__(self, density: float, sample_size: int | None = None, seed: int = 0) -> None:
        super().__init__(density)
        if sample_size is not None and (isinstance(sample_size, bool) or sample_size < 1):
            raise ValueError(f"sample_size must be a positive integer or None, got {sample_size!r}")
        self.sample_size = sample_size
        self.seed = int(seed)
        self._magnitudes = Magnitudes()

    def bind(self, layout: Layout, rank: int, world_size: int, target: int | None = None) -> None:
        super().bind(layout, rank, world_size, target)
        self._samples = self.sample_size or slovin_sample_size(layout.numel)
        self._threshold = initial_threshold(self.target)
        self._previous_mean: float | None = None
        self._generator: torch.Generator | None = None
        self._generator_state: torch.Tensor | None = None
        self._factors = {"alpha": 1.0, "beta": 1.0, "gamma": 1.0, "examined_density": math.nan}

    def framing(self) -> Framing:
        return Padded(self.layout.numel, union=True)

    def select(
        self, accumulated: torch.Tensor, step: int, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        magnitude = self._magnitudes.of(accumulated)
        mean = self._sample_mean(magnitude)
        if self._previous_mean is None:
            self._factors["sample_mean"] = mean.item()
        else:
            alpha = mean / self._previous_mean if self._previous_mean > 0 else torch.ones_like(mean)
            sample_mean, alpha_value = torch.stack([mean, alpha]).tolist()
            examined = self._magnitudes.count_at_least(magnitude, self._threshold * alpha_value)
            self._rescale(sample_mean, alpha_value, examined / self.layout.numel)
        self._previous_mean = self._factors["sample_mean"]
        return self._magnitudes.at_least(magnitude, self._threshold)

    def _sample_mean(self, magnitude: torch.Tensor) -> torch.Tensor:
        """Mean |a| at ``sample_size`` random positions, drawn and gathered at once (0-d)."""
        if self._generator is None or self._generator.device != magnitude.device:
            self._generator = torch.Generator(device=magnitude.device)
            self._generator.manual_seed(self.seed * self.world_size + self.rank)
            if self._generator_state is not None:
                self._generator.set_state(self._generator_state)
        positions = torch.randint(
            self.layout.numel, (self._samples,), generator=self._generator, device=magnitude.device
        )
        return magnitude.index_select(0, positions).mean(dtype=torch.float64)

    def _rescale(self, sample_mean: float, alpha: float, examined_density: float) -> None:
        density = self.current_density
        beta = 2.0 / (1.0 + math.exp(density - examined_density))
        ratio = examined_density / density
        gamma = 0.95 if ratio < 0.1 else 1.05 if ratio > 10.0 else 1.0
        self._threshold *= alpha * beta * gamma
        self._factors = {
            "sample_mean": sample_mean,
            "alpha": alpha,
            "beta": beta,
            "gamma": gamma,
            "examined_density": examined_density,
        }

    @property
    def threshold(self) -> float:
        return self._threshold

    def settle(self, threshold: float) -> bool:
        self._threshold = float(threshold)
        return True

    def report(self) -> dict[str, float]:
        return dict(self._factors)

    def state_dict(self) -> dict[str, Any]:
        generator = self._generator.get_state() if self._generator is not None else None
        return {
            "threshold": self._threshold,
            "previous_mean": self._previous_mean,
            "generator": generator if generator is not None else self._generator_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._threshold = float(state["threshold"])
        self._previous_mean = state["previous_mean"]
        self._generator_state = state["generator"]
        if self._generator is not None and self._generator_state is not None:
            self._generator.set_state(self._generator_state)
