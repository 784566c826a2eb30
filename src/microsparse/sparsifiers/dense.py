"""Dense: no sparsification, the plain all-reduce average (the reference for accuracy and speed)."""

from __future__ import annotations

import torch

from microsparse.comm.framing import Dense as DenseFraming
from microsparse.comm.framing import Framing
from microsparse.layout import Layout
from microsparse.sparsifiers.base import Sparsifier
from microsparse.sparsifiers.registry import register_sparsifier


@register_sparsifier
class Dense(Sparsifier):
    """Every entry is sent: one all-reduce of all d values, divided by n.

    The result equals ``all_reduce(grad) / n`` bit for bit, and the residual stays zero.
    ``density`` is accepted for a uniform interface and ignored (the target is d).

    Example:
        >>> reducer = GradientReducer(params, sparsifier="dense")  # doctest: +SKIP
    """

    name = "dense"
    framing_class = DenseFraming

    def __init__(self, density: float = 1.0) -> None:
        super().__init__(density)

    def bind(self, layout: Layout, rank: int, world_size: int, target: int | None = None) -> None:
        super().bind(layout, rank, world_size, layout.numel)
        self._nothing = torch.empty(0, dtype=torch.long)

    def framing(self) -> Framing:
        return DenseFraming()

    def select(
        self, accumulated: torch.Tensor, step: int, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._nothing.to(accumulated.device)
