"""Hard threshold: a fixed λ = 1/(2·sqrt(k)) over the whole vector, on every worker."""

from __future__ import annotations

import torch

from microsparse.comm.framing import Framing, Padded
from microsparse.layout import Layout
from microsparse.sparsifiers.base import Magnitudes, Sparsifier
from microsparse.sparsifiers.registry import register_sparsifier
from microsparse.sparsifiers.threshold import initial_threshold


@register_sparsifier
class HardThreshold(Sparsifier):
    """Send every entry with |a| >= 1/(2·sqrt(k)); the threshold never changes
    (docs/METHOD.md, "Baselines").

    One compare over all d entries per rank. Nothing ties the count to k, so the density
    drifts with the gradient scale, and the union over ranks adds build-up.

    Example:
        >>> reducer = GradientReducer(params, "hard_threshold", density=0.001)  # doctest: +SKIP
    """

    name = "hard_threshold"
    framing_class = Padded

    def __init__(self, density: float) -> None:
        super().__init__(density)
        self._magnitudes = Magnitudes()

    def bind(self, layout: Layout, rank: int, world_size: int, target: int | None = None) -> None:
        super().bind(layout, rank, world_size, target)
        self._threshold = initial_threshold(self.target)

    def retarget(self, target: int) -> None:
        super().retarget(target)
        self._threshold = initial_threshold(target)  # the rule's λ for this k

    def framing(self) -> Framing:
        return Padded(self.layout.numel, union=True)

    def select(
        self, accumulated: torch.Tensor, step: int, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._magnitudes.at_least(self._magnitudes.of(accumulated), self._threshold)

    @property
    def threshold(self) -> float:
        return self._threshold
