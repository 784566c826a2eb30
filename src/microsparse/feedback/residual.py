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

    With ``momentum`` m > 0 it applies *momentum correction* (Deep Gradient Compression): each
    worker keeps a velocity u ← m·u + g, the residual accumulates u (with ``nesterov``,
    g + m·u) instead of g, and every sent position is zeroed in u too (momentum factor
    masking). The averaged values then carry the momentum, so the optimiser must run without
    its own.

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
        momentum: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        self.momentum = check_momentum(momentum)
        self.nesterov = bool(nesterov)
        self.transactional = transactional

        def pair() -> list[FlatVector]:
            committed = FlatVector(layout, dtype, device)
            return [committed, FlatVector(layout, dtype, device) if transactional else committed]

        self._residual = pair()  # [committed, working]: one object unless transactional
        self._velocity = pair() if self.momentum else None

    @property
    def accumulated(self) -> torch.Tensor:
        """a of the step in progress (the residual itself unless transactional)."""
        return self._residual[1].data

    @property
    def residual(self) -> torch.Tensor:
        """e as of the last committed step."""
        return self._residual[0].data

    @property
    def velocity(self) -> torch.Tensor | None:
        """u as of the last committed step with momentum correction, else None."""
        return None if self._velocity is None else self._velocity[0].data

    @property
    def buffers(self) -> list[FlatVector]:
        """What a worker carries between steps: e, then u with momentum correction."""
        return [self._residual[0]] + ([] if self._velocity is None else [self._velocity[0]])

    @property
    def views(self) -> list[torch.Tensor]:
        """:attr:`residual` shaped like each parameter."""
        return self._residual[0].views

    def compensate(self, fresh: Fresh) -> None:
        """a ← e + g, or with momentum correction u ← m·u + g and a ← e + u (Nesterov:
        e + g + m·u). A missing gradient (unused parameter) counts as zero."""
        if self._velocity is None:
            _add_into(self._residual, fresh)
            return
        _add_into(self._velocity, fresh, self.momentum)
        velocity = self._velocity[1].data
        if self.nesterov:
            _add_into(self._residual, fresh)
            self.accumulated.add_(velocity, alpha=self.momentum)
        else:
            _add_into(self._residual, velocity)

    def forget(self, sent: torch.Tensor, remainder: torch.Tensor | None = None) -> None:
        """e ← a with every sent position zeroed (or set to ``remainder``, what rounding the
        sent values left behind), and u zeroed there: O(K), no dense pass."""
        if remainder is None:
            self.accumulated.index_fill_(0, sent, 0)
        else:
            self.accumulated.index_copy_(0, sent, remainder)
        if self._velocity is not None:  # momentum factor masking
            self._velocity[1].data.index_fill_(0, sent, 0)

    def commit(self) -> None:
        """The step succeeded: its a, with the sent positions forgotten, is the residual."""
        for pair in (self._residual, self._velocity):
            if pair is not None:
                pair.reverse()


def check_momentum(momentum: float) -> float:
    """``momentum`` as a float in [0, 1), or raise naming the option."""
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        raise TypeError(f"momentum_correction must be a number in [0, 1), got {momentum!r}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(
            f"momentum_correction must be in [0, 1) (the optimiser's momentum, e.g. 0.9), "
            f"got {momentum!r}"
        )
    return float(momentum)


def _add_into(pair: list[FlatVector], fresh: Fresh, scale: float = 1.0) -> None:
    """working ← scale·committed + fresh (in place when they are one); ``None`` counts as 0."""
    base, out = pair
    if isinstance(fresh, torch.Tensor):
        flat = fresh.view(-1)
        if out is not base:
            torch.add(flat, base.data, alpha=scale, out=out.data)
            return
        if scale != 1.0:
            base.data.mul_(scale)
        base.data.add_(flat)
        return
    if out is not base:
        for target, source, g in zip(out.views, base.views, fresh):
            if g is None:
                torch.mul(source, scale, out=target)
            else:
                torch.add(g, source, alpha=scale, out=target)
        return
    if scale != 1.0:
        torch._foreach_mul_(base.views, scale)
    pairs = [(view, g) for view, g in zip(base.views, fresh) if g is not None]
    if pairs:
        torch._foreach_add_([view for view, _ in pairs], [g for _, g in pairs])


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
