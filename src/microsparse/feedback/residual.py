"""Error feedback: nothing that is not sent is lost, only delayed.

One flat vector holds the residual e between steps. ``compensate`` adds the fresh gradients
into it (a = g + e, no copy of the gradients), selection and exchange read a, and ``forget``
zeroes every position whose value was sent, which leaves the new residual.

A *transactional* residual keeps e untouched until the step commits: a is written into a
second buffer (one more write stream per step), and :meth:`ErrorFeedback.commit` swaps the
two. A step that fails (a NaN or Inf anywhere) is then skipped by not committing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
        >>> memory.commit()
        >>> memory.residual.tolist()           # the residual keeps the rest
        [1.0, -2.0, 0.0, 0.5]
    """

    def __init__(
        self,
        layout: Layout,
        dtype: torch.dtype,
        device: torch.device,
        transactional: bool = False,
    ) -> None:
        self._committed = FlatVector(layout, dtype, device)
        self._working = FlatVector(layout, dtype, device) if transactional else self._committed
        self.transactional = transactional

    @property
    def accumulated(self) -> torch.Tensor:
        """a of the step in progress (the residual itself unless transactional)."""
        return self._working.data

    @property
    def residual(self) -> torch.Tensor:
        """e as of the last committed step."""
        return self._committed.data

    @property
    def views(self) -> list[torch.Tensor]:
        """:attr:`residual` shaped like each parameter."""
        return self._committed.views

    def compensate(self, fresh: Fresh) -> None:
        """a ← e + g. A missing gradient (unused parameter) counts as zero."""
        base, working = self._committed, self._working
        if isinstance(fresh, torch.Tensor):
            if working is base:
                working.data.add_(fresh.view(-1))
            else:
                torch.add(base.data, fresh.view(-1), out=working.data)
            return
        if working is not base:
            for out, e, g in zip(working.views, base.views, fresh):
                if g is None:
                    out.copy_(e)
                else:
                    torch.add(e, g, out=out)
            return
        pairs = [(view, g) for view, g in zip(base.views, fresh) if g is not None]
        if pairs:
            torch._foreach_add_([view for view, _ in pairs], [g for _, g in pairs])

    def forget(self, sent: torch.Tensor) -> None:
        """e ← a with every sent position zeroed: O(K), no dense pass."""
        self.accumulated.index_fill_(0, sent, 0)

    def commit(self) -> None:
        """The step succeeded: its a, with the sent positions forgotten, is the residual."""
        if self._working is not self._committed:
            self._committed, self._working = self._working, self._committed


class ResidualScale:
    """Keeps a residual of scaled gradients in the units of a ``GradScaler``'s current scale.

    Example:
        >>> scale = ResidualScale(None)   # no scaler: nothing to follow
        >>> scale.follow(torch.ones(3)), scale.scale
        (None, None)
    """

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self.scale: float | None = None

    def follow(self, *residuals: torch.Tensor) -> None:
        """Rescale ``residuals`` in place if the scaler's scale changed since the last call."""
        if self.scaler is None or not self.scaler.is_enabled():
            return
        scale = float(self.scaler.get_scale())
        if self.scale is not None and scale != self.scale:
            for residual in residuals:
                residual.mul_(scale / self.scale)
        self.scale = scale


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
