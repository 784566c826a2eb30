"""CLT-k: a cyclic leader picks its top-k and every worker sends its values there."""

from __future__ import annotations

import torch

from microsparse.comm.collectives import index_dtype
from microsparse.comm.framing import Framing, Shared
from microsparse.sparsifiers.base import Magnitudes, Sparsifier
from microsparse.sparsifiers.registry import register_sparsifier


@register_sparsifier
class CyclicLocalTopK(Sparsifier):
    """CLT-k (docs/METHOD.md, "Baselines"): at step t the leader, rank t mod n, selects the
    top-k of its own |a|, broadcasts those k positions, and all ranks average their values
    there.

    Exactly k positions per step, no build-up. Only the leader computes the top-k (the
    reference code computes it on every worker and throws n − 1 of them away), but the others
    wait for it: the step's selection time is the leader's top-k plus the broadcast.

    Example:
        >>> reducer = GradientReducer(params, sparsifier="cltk", density=0.001)  # doctest: +SKIP
    """

    name = "cltk"
    framing_class = Shared
    planned = True

    def __init__(self, density: float) -> None:
        super().__init__(density)
        self._magnitudes = Magnitudes()

    def framing(self) -> Framing:
        return Shared()

    def empty_plan(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.target, dtype=index_dtype(self.layout.numel), device=device)

    def make_plan(self, accumulated: torch.Tensor, step: int) -> torch.Tensor:
        magnitude = self._magnitudes.of(accumulated)
        chosen = torch.topk(magnitude, self.target, sorted=False).indices
        return chosen.to(index_dtype(self.layout.numel))

    def adopt_plan(self, plan: torch.Tensor, step: int) -> list[int]:
        self._positions = plan.long()
        self._leader = self.leader(step)
        return [self.target] * self.world_size

    def select(
        self, accumulated: torch.Tensor, step: int, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._positions

    def report(self) -> dict[str, int]:
        return {"leader": self._leader}
