"""MiCRO: threshold selection inside an exclusively owned, rotating partition."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from microsparse.layout import Layout
from microsparse.sparsifiers import register_sparsifier
from microsparse.sparsifiers.base import Sparsifier
from microsparse.sparsifiers.partition import PARTITIONINGS, Segment, owned_partition
from microsparse.sparsifiers.threshold import (
    THRESHOLD_RULES,
    QuantileThreshold,
    ThresholdController,
    ThresholdRule,
)

Partitioning = Literal["interleaved", "contiguous"]
IndexMessage = Literal["fixed", "padded"]


@register_sparsifier
class Micro(Sparsifier):
    """MiCRO (Yoon & Oh, HiPC 2023); the reference code's behaviour is one set of options.

    1. The flat vector is cut into n near-equal partitions (``partitioning``).
    2. At step t, rank r owns partition (t + r) mod n: no two ranks select the same
       position, so the union of all selections has exactly K = Σ k_r entries (no build-up).
    3. Rank r selects the positions of its partition with |a| >= λ: one compare over d/n
       entries, no sort. If nothing passes, it sends one fallback position (the
       (t mod size)-th entry of its partition) so that its message is never empty.
    4. λ, identical on every rank, comes from ``threshold_rule``.

    Options:
        threshold_rule: ``"quantile"`` (default): λ is estimated from the current step's
            data through one all-reduce of a small histogram, so the actual density is on
            target from the first steps and after gradient-scale changes. ``"symmetric"``
            and ``"as_coded"``: the paper's ±0.5 %-per-step correction from the previous
            step's count (``as_coded`` keeps the reference's dead branch).
        partitioning: ``"interleaved"`` (default): small blocks dealt round-robin, so every
            partition holds a slice of every layer and the per-rank counts are balanced.
            ``"contiguous"``: the reference's n contiguous ranges.
        index_message: ``"fixed"`` (default): each rank sends one all-gather message of
            ``ceil(capacity_factor · k / n) + 8`` int32 slots that carries its own count and
            the step's checks, so no separate count round is needed. If more positions pass
            the threshold, the largest are sent and the rest stay in the residual
            (``StepStats.proposed − selected`` counts them). ``"padded"``: the reference's
            count all-gather, then indices padded to the largest count.
        capacity_factor: slack of the fixed message over an even share k / n.

    ``threshold_rule="as_coded", partitioning="contiguous", index_message="padded"``
    reproduces the reference code.

    Example:
        >>> import torch
        >>> from microsparse import GradientReducer
        >>> model = torch.nn.Linear(1000, 100)
        >>> reference = GradientReducer(model.parameters(), "micro", 0.001,
        ...     threshold_rule="as_coded", partitioning="contiguous", index_message="padded")
    """

    name = "micro"
    exchange = "exclusive"

    def __init__(
        self,
        density: float,
        threshold_rule: ThresholdRule = "quantile",
        partitioning: Partitioning = "interleaved",
        index_message: IndexMessage = "fixed",
        capacity_factor: float = 1.25,
    ) -> None:
        super().__init__(density)
        if threshold_rule not in THRESHOLD_RULES:
            raise ValueError(
                f"threshold_rule must be one of {', '.join(THRESHOLD_RULES)}; "
                f"got {threshold_rule!r}"
            )
        if partitioning not in PARTITIONINGS:
            raise ValueError(
                f"partitioning must be one of {', '.join(PARTITIONINGS)}; got {partitioning!r}"
            )
        if index_message not in ("fixed", "padded"):
            raise ValueError(f"index_message must be fixed or padded; got {index_message!r}")
        if not isinstance(capacity_factor, (int, float)) or not 1 <= capacity_factor < math.inf:
            raise ValueError(f"capacity_factor must be a number >= 1, got {capacity_factor!r}")
        self.threshold_rule = threshold_rule
        self.partitioning = partitioning
        self.index_message = index_message
        self.capacity_factor = float(capacity_factor)
        self.exchange = "fixed" if index_message == "fixed" else "exclusive"

    def bind(self, layout: Layout, rank: int, world_size: int) -> None:
        super().bind(layout, rank, world_size)
        self._partitions = PARTITIONINGS[self.partitioning](layout.numel, world_size)
        self.capacity = math.ceil(self.capacity_factor * self.target / world_size) + 8
        self._rule: QuantileThreshold | ThresholdController = (
            QuantileThreshold(self.target)
            if self.threshold_rule == "quantile"
            else ThresholdController(self.target, self.threshold_rule)
        )
        self._scratch: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._magnitudes_ready = False

    def _part(self, step: int) -> int:
        return owned_partition(step, self.rank, self.world_size)

    def partition(self, step: int) -> tuple[int, int] | None:
        return self._partitions.range(self._part(step))

    def agreement(self, accumulated: torch.Tensor, step: int) -> torch.Tensor | None:
        if not isinstance(self._rule, QuantileThreshold):
            return None
        magnitudes = [magnitude for magnitude, _ in self._magnitudes(accumulated, step)]
        scratch = self._mask_and_logs(accumulated)[1]
        return self._rule.histogram(magnitudes, scratch)

    def adopt_agreement(self, total: torch.Tensor) -> None:
        assert isinstance(self._rule, QuantileThreshold)
        self._rule.solve(total)

    def select(self, accumulated: torch.Tensor, step: int) -> torch.Tensor:
        part = self._part(step)
        size = self._partitions.size(part)
        if size == 0:  # only when d < n
            return torch.empty(0, dtype=torch.long, device=accumulated.device)
        mask = self._mask_and_logs(accumulated)[0]
        chosen = []
        for magnitude, segment in self._magnitudes(accumulated, step, reuse=True):
            out = mask[: magnitude.numel()].view_as(magnitude)
            passed = torch.ge(magnitude, self._rule.threshold, out=out)
            rows, cols = torch.nonzero(passed, as_tuple=True)
            chosen.append(segment.positions(rows, cols))
        positions = torch.cat(chosen) if len(chosen) > 1 else chosen[0]
        if positions.numel() == 0:
            return self._fallback(accumulated, part, step % size)
        return positions

    def _magnitudes(
        self, accumulated: torch.Tensor, step: int, reuse: bool = False
    ) -> list[tuple[torch.Tensor, Segment]]:
        """|a| of each owned segment, in the preallocated buffer.

        With ``reuse``, magnitudes computed by this step's ``agreement`` are taken as they are.
        """
        if self._scratch is None:
            largest = max(self._partitions.size(p) for p in range(self.world_size))
            self._scratch = torch.empty(largest, dtype=accumulated.dtype, device=accumulated.device)
        fresh = not (reuse and self._magnitudes_ready)
        out, offset = [], 0
        for segment in self._partitions.segments(accumulated, self._part(step)):
            magnitude = self._scratch[offset : offset + segment.view.numel()].view_as(segment.view)
            if fresh:
                torch.abs(segment.view, out=magnitude)
            out.append((magnitude, segment))
            offset += segment.view.numel()
        self._magnitudes_ready = not reuse
        return out

    def _mask_and_logs(self, accumulated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._mask is None:
            largest = max(self._partitions.size(p) for p in range(self.world_size))
            self._mask = torch.empty(largest, dtype=torch.bool, device=accumulated.device)
            self._logs = torch.empty(largest, dtype=accumulated.dtype, device=accumulated.device)
        return self._mask, self._logs

    def _fallback(self, accumulated: torch.Tensor, part: int, index: int) -> torch.Tensor:
        for segment in self._partitions.segments(accumulated, part):
            if index < segment.view.numel():
                row, col = divmod(index, segment.view.shape[1])
                position = segment.base + row * segment.row_stride + col
                return torch.tensor([position], dtype=torch.long, device=accumulated.device)
            index -= segment.view.numel()
        raise AssertionError("fallback index outside the partition")

    def update(self, selected: int) -> None:
        if isinstance(self._rule, ThresholdController):
            self._rule.update(selected)

    @property
    def threshold(self) -> float:
        return self._rule.threshold

    def options(self) -> dict[str, Any]:
        return {
            "threshold_rule": self.threshold_rule,
            "partitioning": self.partitioning,
            "index_message": self.index_message,
            "capacity_factor": self.capacity_factor,
        }

    def state_dict(self) -> dict[str, Any]:
        return self._rule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rule.load_state_dict(state)
