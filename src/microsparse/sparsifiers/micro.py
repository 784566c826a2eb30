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
Selection = Literal["quota", "threshold"]
SELECTIONS = ("quota", "threshold")


@register_sparsifier
class Micro(Sparsifier):
    """MiCRO (Yoon & Oh, HiPC 2023); the reference code's behaviour is one set of options.

    1. The flat vector is cut into n near-equal partitions (``partitioning``).
    2. At step t, rank r owns partition (t + r) mod n: no two ranks select the same
       position, so the union of all selections has exactly K = Σ k_r entries (no build-up).
    3. Rank r selects by threshold inside its partition (``selection``): one compare over
       d/n entries, no sort.

    Options:
        selection: ``"quota"`` (the default unless a ``threshold_rule`` is given): at step t
            every rank sends exactly its quota q_t of the largest |a| of its partition, the
            same q_t on every rank: ⌊(t+1)·k/n⌋ − ⌊t·k/n⌋, k/n rounded down or up so that
            the quotas of steps 0..t sum to ⌊(t+1)·k/n⌋ (the density is exact over time,
            and each step's K = n·q_t is within n of k). A rank finds its q_t largest with
            its own histogram of log2|a| (one pass over d/n, no collective), one compare,
            and a top-k over the few candidates in the edge bins. All ranks send the same
            count (no imbalance: the index message of ⌈k/n⌉ slots is full or one short), and
            no histogram all-reduce is needed.
            ``"threshold"`` (the default when a ``threshold_rule`` is given): the paper's
            rule. Every rank sends every position of its partition with |a| >= λ, one λ
            shared by all ranks from ``threshold_rule``, so the counts k_r differ by rank. If
            nothing passes, a rank sends one fallback position (the (t mod size)-th entry of
            its partition), so that its message is never empty.
        threshold_rule: only with ``selection="threshold"``. ``"quantile"`` (default): λ is
            estimated from the current step's data through one all-reduce of a small
            histogram, so the actual density is on target from the first steps and after
            gradient-scale changes. ``"symmetric"`` and ``"as_coded"``: the paper's
            ±0.5 %-per-step correction from the previous step's count (``as_coded`` keeps
            the reference's dead branch).
        partitioning: ``"interleaved"`` (default): small blocks dealt round-robin, so every
            partition holds a slice of every layer and the per-rank counts are balanced.
            ``"contiguous"``: the reference's n contiguous ranges.
        index_message: ``"fixed"`` (default): each rank sends one all-gather message of int32
            slots that carries its own count and the step's checks, so no separate count
            round is needed: ⌈k/n⌉ slots with quotas, ``ceil(capacity_factor · k / n) + 8``
            with a shared threshold. If more positions pass the threshold, the largest are
            sent and the rest stay in the residual (``StepStats.proposed − selected`` counts
            them). ``"padded"``: the reference's count all-gather, then indices padded to the
            largest count.
        capacity_factor: slack of the fixed message over an even share k / n (threshold
            selection).

    ``selection="threshold", threshold_rule="as_coded", partitioning="contiguous",
    index_message="padded"`` reproduces the reference code.

    Example:
        >>> import torch
        >>> from microsparse import GradientReducer
        >>> model = torch.nn.Linear(1000, 100)
        >>> reference = GradientReducer(model.parameters(), "micro", 0.001,
        ...     selection="threshold", threshold_rule="as_coded", partitioning="contiguous",
        ...     index_message="padded")
    """

    name = "micro"
    exchange = "exclusive"

    def __init__(
        self,
        density: float,
        selection: Selection | None = None,
        threshold_rule: ThresholdRule | None = None,
        partitioning: Partitioning = "interleaved",
        index_message: IndexMessage = "fixed",
        capacity_factor: float = 1.25,
    ) -> None:
        super().__init__(density)
        if selection is None:  # naming a threshold rule asks for a shared threshold
            selection = "quota" if threshold_rule is None else "threshold"
        if threshold_rule is None:
            threshold_rule = "quantile"
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}; got {selection!r}")
        if selection == "quota" and threshold_rule != "quantile":
            raise ValueError(
                f"threshold_rule={threshold_rule!r} needs selection='threshold': with "
                "selection='quota' every rank finds its own threshold from its own histogram"
            )
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
        self.selection = selection
        self.threshold_rule = threshold_rule
        self.partitioning = partitioning
        self.index_message = index_message
        self.capacity_factor = float(capacity_factor)
        self.exchange = "fixed" if index_message == "fixed" else "exclusive"

    def bind(self, layout: Layout, rank: int, world_size: int) -> None:
        super().bind(layout, rank, world_size)
        self._partitions = PARTITIONINGS[self.partitioning](layout.numel, world_size)
        self._largest = max(self._partitions.size(p) for p in range(world_size))
        if self.selection == "quota":  # room for the larger of the two quotas q_t takes
            self.capacity = min(math.ceil(self.target / world_size), self._largest)
        else:
            self.capacity = math.ceil(self.capacity_factor * self.target / world_size) + 8
        self._rule: QuantileThreshold | ThresholdController = (
            QuantileThreshold(self.target)
            if self.threshold_rule == "quantile"
            else ThresholdController(self.target, self.threshold_rule)
        )
        self._scratch: torch.Tensor | None = None
        self._magnitudes_ready = False

    def _part(self, step: int) -> int:
        return owned_partition(step, self.rank, self.world_size)

    def partition(self, step: int) -> tuple[int, int] | None:
        return self._partitions.range(self._part(step))

    def agreement(self, accumulated: torch.Tensor, step: int) -> torch.Tensor | None:
        if self.selection == "quota" or not isinstance(self._rule, QuantileThreshold):
            return None
        magnitudes = [magnitude for magnitude, _ in self._magnitudes(accumulated, step)]
        scratch = self._buffers(accumulated)[2]
        return self._rule.histogram(magnitudes, scratch)

    def adopt_agreement(self, total: torch.Tensor) -> None:
        assert isinstance(self._rule, QuantileThreshold)
        self._rule.solve(total)

    def select(self, accumulated: torch.Tensor, step: int) -> torch.Tensor:
        part = self._part(step)
        size = self._partitions.size(part)
        if size == 0:  # only when d < n
            return torch.empty(0, dtype=torch.long, device=accumulated.device)
        if self.selection == "quota":
            return self._select_quota(accumulated, step, min(self.quota(step), size))
        mask = self._buffers(accumulated)[1]
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

    def quota(self, step: int) -> int:
        """q_t, what every rank sends at ``step`` with ``selection="quota"``.

        Example:
            >>> from microsparse.layout import Layout
            >>> micro = Micro(density=0.001)
            >>> micro.bind(Layout.of([("w", torch.empty(215_370))]), rank=0, world_size=64)
            >>> [micro.quota(t) for t in range(6)]  # k / n = 215 / 64 = 3.36
            [3, 3, 4, 3, 3, 4]
        """
        k, n = self.target, self.world_size
        return (step + 1) * k // n - step * k // n

    def _select_quota(self, accumulated: torch.Tensor, step: int, quota: int) -> torch.Tensor:
        """The ``quota`` largest |a| of the owned partition (ties: any of them)."""
        if quota == 0:
            return torch.empty(0, dtype=torch.long, device=accumulated.device)
        assert isinstance(self._rule, QuantileThreshold)
        owned = self._magnitudes(accumulated, step)
        _, mask, logs = self._buffers(accumulated)
        histogram = self._rule.histogram([magnitude for magnitude, _ in owned], logs)
        edge = self._rule.candidate_edge(histogram, quota)
        chosen, magnitudes = [], []
        for magnitude, segment in owned:
            out = mask[: magnitude.numel()].view_as(magnitude)
            rows, cols = torch.nonzero(torch.ge(magnitude, edge, out=out), as_tuple=True)
            chosen.append(segment.positions(rows, cols))
            magnitudes.append(magnitude[rows, cols])
        candidates = torch.cat(chosen) if len(chosen) > 1 else chosen[0]
        if candidates.numel() <= quota:  # only when the partition holds no more than that
            return candidates
        values = torch.cat(magnitudes) if len(magnitudes) > 1 else magnitudes[0]
        return candidates.index_select(0, torch.topk(values, quota, sorted=False).indices)

    def _magnitudes(
        self, accumulated: torch.Tensor, step: int, reuse: bool = False
    ) -> list[tuple[torch.Tensor, Segment]]:
        """|a| of each owned segment, in the preallocated buffer.

        With ``reuse``, magnitudes computed by this step's ``agreement`` are taken as they are.
        """
        scratch = self._buffers(accumulated)[0]
        fresh = not (reuse and self._magnitudes_ready)
        out, offset = [], 0
        for segment in self._partitions.segments(accumulated, self._part(step)):
            magnitude = scratch[offset : offset + segment.view.numel()].view_as(segment.view)
            if fresh:
                torch.abs(segment.view, out=magnitude)
            out.append((magnitude, segment))
            offset += segment.view.numel()
        self._magnitudes_ready = not reuse
        return out

    def _buffers(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Magnitudes, compare mask and log2 magnitudes of the largest partition, made once."""
        if self._scratch is None:
            size, device = self._largest, like.device
            self._scratch = torch.empty(size, dtype=like.dtype, device=device)
            self._mask = torch.empty(size, dtype=torch.bool, device=device)
            self._logs = torch.empty(size, dtype=like.dtype, device=device)
        return self._scratch, self._mask, self._logs

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
            "selection": self.selection,
            "threshold_rule": self.threshold_rule,
            "partitioning": self.partitioning,
            "index_message": self.index_message,
            "capacity_factor": self.capacity_factor,
        }

    def state_dict(self) -> dict[str, Any]:
        return self._rule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rule.load_state_dict(state)
