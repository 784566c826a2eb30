"""MiCRO: threshold selection inside an exclusively owned, rotating partition."""

from __future__ import annotations

from typing import Any

import torch

from microsparse.layout import Layout
from microsparse.sparsifiers import register_sparsifier
from microsparse.sparsifiers.base import Sparsifier
from microsparse.sparsifiers.partition import contiguous_partitions, owned_partition
from microsparse.sparsifiers.threshold import ThresholdController, ThresholdRule


@register_sparsifier
class Micro(Sparsifier):
    """MiCRO (Yoon & Oh, HiPC 2023), as in the authors' reference code.

    1. The flat vector is cut into n near-equal contiguous partitions.
    2. At step t, rank r owns partition (t + r) mod n: no two ranks select the same
       position, so the union of all selections has exactly K = Σ k_r entries (no build-up).
    3. Rank r selects the positions of its partition with |a| >= λ: one compare over d/n
       entries, no sort. If nothing passes, it sends one fallback position,
       ``start + t mod size``, so that its message is never empty.
    4. λ is corrected every step from the previous step's global K (``threshold_rule``).

    Example:
        >>> reducer = GradientReducer(model.parameters(), sparsifier="micro",  # doctest: +SKIP
        ...                           density=0.001, threshold_rule="symmetric")
    """

    name = "micro"
    exchange = "exclusive"

    def __init__(self, density: float, threshold_rule: ThresholdRule = "symmetric") -> None:
        super().__init__(density)
        self.threshold_rule = threshold_rule
        # Validate now, so that a bad rule fails at construction, before any collective.
        ThresholdController(1, threshold_rule)

    def bind(self, layout: Layout, rank: int, world_size: int) -> None:
        super().bind(layout, rank, world_size)
        self._partitions = contiguous_partitions(layout.numel, world_size)
        self._controller = ThresholdController(self.target, self.threshold_rule)
        self._scratch: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    def partition(self, step: int) -> tuple[int, int]:
        return self._partitions[owned_partition(step, self.rank, self.world_size)]

    def select(self, accumulated: torch.Tensor, step: int) -> torch.Tensor:
        start, end = self.partition(step)
        size = end - start
        if size == 0:  # only when d < n
            return torch.empty(0, dtype=torch.long, device=accumulated.device)
        magnitude, mask = self._buffers(accumulated, size)
        torch.abs(accumulated[start:end], out=magnitude)
        torch.ge(magnitude, self._controller.threshold, out=mask)
        chosen = torch.nonzero(mask).squeeze(1)
        if chosen.numel() == 0:
            return torch.tensor([start + step % size], dtype=torch.long, device=accumulated.device)
        return chosen.add_(start)

    def _buffers(self, accumulated: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Preallocated once for the largest partition: fresh allocations of d/n floats
        # every step cost page faults that dominate a threshold compare.
        if self._scratch is None:
            largest = max(end - start for start, end in self._partitions)
            self._scratch = torch.empty(largest, dtype=accumulated.dtype, device=accumulated.device)
            self._mask = torch.empty(largest, dtype=torch.bool, device=accumulated.device)
        assert self._mask is not None
        return self._scratch[:size], self._mask[:size]

    def update(self, selected: int) -> None:
        self._controller.update(selected)

    @property
    def threshold(self) -> float:
        return self._controller.threshold

    def options(self) -> dict[str, Any]:
        return {"threshold_rule": self.threshold_rule}

    def state_dict(self) -> dict[str, Any]:
        return self._controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._controller.load_state_dict(state)
