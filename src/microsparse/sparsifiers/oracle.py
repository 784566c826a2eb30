"""The oracle: the exact top-k of the sum of every worker's accumulated gradient (a bound)."""

from __future__ import annotations

import torch

from microsparse.comm.framing import Framing, Shared
from microsparse.sparsifiers.base import Sparsifier
from microsparse.sparsifiers.registry import register_sparsifier


@register_sparsifier
class Oracle(Sparsifier):
    """Send the k positions where |Σ_r a_r| is largest: the best any top-k selection can do.

    Every selection with error feedback chooses k positions from what one rank can see: its
    own accumulated gradient a_r (top-k, MiCRO's owner of a partition) or one leader's
    (CLT-k). The positions that would help most are those where the *sum* Σ_r a_r, which
    the step then averages, is largest. This sparsifier learns that sum through a dense
    all-reduce of a before selecting, so it costs more bytes than dense averaging itself
    (``StepStats.bytes_sent`` counts them): it is a yardstick for the training-quality
    study, the accuracy a selection of k positions can reach at all, not a method to train
    with. Every rank selects the same k positions (an all-reduce leaves the same sum on
    every rank, in gloo and NCCL alike), so the aggregated gradient has exactly k entries
    and each residual keeps the rest. In the DDP hook with ``find_unused_parameters``, a
    rank sends 0 at the positions of parameters it did not use and keeps its residual there.

    Example:
        >>> import torch
        >>> from microsparse import GradientReducer
        >>> model = torch.nn.Linear(1000, 100)
        >>> bound = GradientReducer(model.parameters(), "oracle", 0.001)
    """

    name = "oracle"
    framing_class = Shared
    yardstick = True

    def __init__(self, density: float) -> None:
        super().__init__(density)
        self._sum: torch.Tensor | None = None

    def framing(self) -> Framing:
        return Shared()

    @property
    def agrees(self) -> bool:
        return True

    def agreement(self, accumulated: torch.Tensor, step: int) -> torch.Tensor:
        if self._sum is None or self._sum.device != accumulated.device:
            self._sum = torch.empty_like(accumulated)
        return self._sum.copy_(accumulated)  # the all-reduce sums it in place

    def adopt_agreement(self, total: torch.Tensor) -> None:
        # A NaN or Inf in any rank's a is in the sum, is taken first, and fails the step.
        # The sum is this step's only; its magnitude can take its place (no allocation).
        self._positions = torch.topk(total.abs_(), self.target, sorted=False).indices

    def select(
        self, accumulated: torch.Tensor, step: int, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._positions
