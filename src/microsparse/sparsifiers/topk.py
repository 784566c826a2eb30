"""Top-k: every worker sends its own k largest entries; the union of all picks is averaged."""

from __future__ import annotations

from typing import Literal

import torch

from microsparse.comm.framing import FixedUnion, Framing, Padded
from microsparse.sparsifiers.base import Magnitudes, Sparsifier
from microsparse.sparsifiers.registry import register_sparsifier

TopKWire = Literal["union", "fixed"]
TOPK_WIRES = ("union", "fixed")


@register_sparsifier
class TopK(Sparsifier):
    """Exact per-worker top-k of |a| over all d entries (docs/METHOD.md, "Baselines").

    Every rank picks its own k positions, so the union K lies between k (all ranks agree) and
    n·k (no overlap): the *gradient build-up* that ``StepStats.build_up`` reports. Selection
    costs a top-k over d entries on every rank.

    Args:
        density: k / d.
        wire: ``"union"`` (default, the paper's): the ranks' counts, then their indices, are
            all-gathered, the union is deduplicated and the values are all-reduced at its K
            positions; K is the data's, so the host reads it every step. ``"fixed"``: one
            all-gather of k indices a rank and an all-reduce of all n·k slots, a position
            several ranks picked summed once (:class:`~microsparse.comm.FixedUnion`): the same
            average and residuals, nothing read back to the host, n·k / K times the values'
            bytes.

    Example:
        >>> reducer = GradientReducer(params, sparsifier="topk", density=0.001)  # doctest: +SKIP
        >>> TopK(0.001, wire="fixed").entry_bytes()
        8
    """

    name = "topk"
    framing_class = Padded

    def __init__(self, density: float, wire: TopKWire = "union") -> None:
        super().__init__(density)
        if wire not in TOPK_WIRES:
            hint = ("the compact wire needs a range each rank owns, which only micro's "
                    "partitions give: use 'micro' with wire='compact'" if wire == "compact"
                    else "'fixed' sends n·k values a step and reads nothing back to the host")
            raise ValueError(
                f"wire must be one of {', '.join(TOPK_WIRES)} for topk; got {wire!r} ({hint})"
            )
        self.wire = wire
        self._magnitudes = Magnitudes()

    def framing(self) -> Framing:
        if self.wire == "fixed":
            return FixedUnion(self.layout.numel)
        return Padded(self.layout.numel, union=True)

    def counts(self, step: int) -> list[int] | None:
        """k for every rank with the fixed wire (``torch.topk`` always returns k)."""
        return [self.target] * self.world_size if self.wire == "fixed" else None

    def select(
        self, accumulated: torch.Tensor, step: int, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        magnitude = self._magnitudes.of(accumulated)
        return torch.topk(magnitude, self.target, sorted=False).indices
