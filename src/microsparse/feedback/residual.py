"""Error feedback: nothing that is not sent is lost, only delayed.

One flat vector holds the residual e between steps. ``compensate`` adds the fresh gradients
into it in place (a = g + e, no copy of the gradients), selection and exchange read a from
it, and ``forget`` zeroes every position whose value was sent, which leaves the new residual.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from microsparse.layout import FlatVector, Layout

Fresh = torch.Tensor | Sequence[torch.Tensor | None]
"""A slab's fresh gradient: one flat tensor, or one tensor per parameter (``None``: none)."""


class ErrorFeedback:
    """The residual of one worker, laid out like the flat gradient vector.

    Example:
        >>> import torch
        >>> layout = Layout.of([("w", torch.zeros(4))])
        >>> memory = ErrorFeedback(layout, torch.float32, torch.device("cpu"))
        >>> memory.compensate([torch.tensor([1.0, -2.0, 3.0, 0.5])])
        >>> memory.forget(torch.tensor([2]))   # position 2 was sent
        >>> memory.accumulated.tolist()        # the residual keeps the rest
        [1.0, -2.0, 0.0, 0.5]
    """

    def __init__(self, layout: Layout, dtype: torch.dtype, device: torch.device) -> None:
        self._vector = FlatVector(layout, dtype, device)
        self.accumulated = self._vector.data
        self.views = self._vector.views
        """``accumulated`` shaped like each parameter."""

    def compensate(self, fresh: Fresh) -> None:
        """a ← e + g, in place. A missing gradient (unused parameter) counts as zero."""
        if isinstance(fresh, torch.Tensor):
            self.accumulated.add_(fresh.view(-1))
            return
        pairs = [(view, g) for view, g in zip(self.views, fresh) if g is not None]
        if pairs:
            torch._foreach_add_([view for view, _ in pairs], [g for _, g in pairs])

    def forget(self, sent: torch.Tensor) -> None:
        """e ← a with every sent position zeroed: O(K), no dense pass."""
        self.accumulated.index_fill_(0, sent, 0)


def any_nonfinite(values: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor, True if ``values`` holds NaN or Inf: one read-only pass, no sync.

    Example:
        >>> any_nonfinite(torch.tensor([1.0, float("inf")])).item()
        True
    """
    # NaN propagates into min and max, and an Inf is the min or the max; unlike a sum, this
    # cannot overflow on large finite values, and it needs no float64 copy of the vector.
    low, high = torch.aminmax(values)
    return ~(torch.isfinite(low) & torch.isfinite(high))
