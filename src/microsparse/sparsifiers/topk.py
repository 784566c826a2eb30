"""Top-k: every worker sends its own k largest entries; the union of all picks is averaged."""

from __future__ import annotations

import torch

from microsparse.comm.framing import Framing, Padded
from microsparse.sparsifiers.base import Magnitudes, Sparsifier
from microsparse.sparsifiers.registry import register_sparsifier


@register_sparsifier
class TopK(Sparsifier):
    """Exact per-worker top-k of |a| over all d entries (docs/METHOD.md, "Baselines").

    Every rank picks its own k positions, so the union K lies between k (all ranks agree) and
    n·k (no overlap): the *gradient build-up* that ``StepStats.build_up`` reports. Selection
    costs a top-k over d entries on every rank.

    Example:
        >>> reducer = GradientReducer(params, sparsifier="topk", density=0.001)  # doctest: +SKIP
    """

    name = "topk"
    framing_class = Padded

    def __init__(self, density: float) -> None:
        super().__init__(density)
        self._magnitudes = Magnitudes()

    def framing(self) -> Framing:
        return Padded(self.layout.numel, union=True)

    def select(
        self, accumulated: torch.Tensor, step: int, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        magnitude = self._magnitudes.of(accumulated)
        return torch.topk(magnitude, self.target, sorted=False).indices
