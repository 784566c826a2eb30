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

    With ``adam`` = (β₁, β₂, ε) it applies *Adam correction*: each worker keeps Adam's moments
    of its own gradients, m ← β₁·m + (1−β₁)·g and v ← β₂·v + (1−β₂)·g², and the residual
    accumulates Adam's step m̂ / (√v̂ + ε) (bias-corrected for the step) instead of g. The
    averaged values are then Adam steps, so the optimiser must be plain SGD at Adam's rate.

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
        adam: tuple[float, float, float] | None = None,
    ) -> None:
        self.momentum = check_momentum(momentum)
        self.nesterov = bool(nesterov)
        self.adam = None if adam is None else check_adam(adam)
        if self.momentum and self.adam:
            raise ValueError(
                "momentum_correction and adam_correction both move the optimiser into the "
                "error feedback: set one of them"
            )
        self.transactional = transactional

        def pair() -> list[FlatVector]:
            committed = FlatVector(layout, dtype, device)
            return [committed, FlatVector(layout, dtype, device) if transactional else committed]

        self._residual = pair()  # [committed, working]: one object unless transactional
        self._velocity = pair() if self.momentum else None
        # Adam's moments, and a scratch for the gradient and the step's denominator
        self._moments = (pair(), pair()) if self.adam else None
        self._scratch = FlatVector(layout, dtype, device) if self.adam else None

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
    def moments(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(m, v) as of the last committed step with Adam correction, else None."""
        if self._moments is None:
            return None
        return self._moments[0][0].data, self._moments[1][0].data

    @property
    def buffers(self) -> list[FlatVector]:
        """What a worker carries between steps: e, then u with momentum correction, or m and
        v with Adam correction."""
        extra = [] if self._velocity is None else [self._velocity[0]]
        if self._moments is not None:
            extra = [pair[0] for pair in self._moments]
        return [self._residual[0], *extra]

    @property
    def views(self) -> list[torch.Tensor]:
        """:attr:`residual` shaped like each parameter."""
        return self._residual[0].views

    def compensate(self, fresh: Fresh, step: int = 0) -> None:
        """a ← e + g, or with momentum correction u ← m·u + g and a ← e + u (Nesterov:
        e + g + m·u), or with Adam correction a ← e + Adam's step number ``step`` (from 0).
        A missing gradient (unused parameter) counts as zero."""
        if self._moments is not None:
            self._adam_step(fresh, step)
            return
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
        for pair in (self._residual, self._velocity, *(self._moments or ())):
            if pair is not None:
                pair.reverse()

    def _adam_step(self, fresh: Fresh, step: int) -> None:
        assert self._moments is not None and self._scratch is not None and self.adam
        beta1, beta2, eps = self.adam
        (first, first_out), (second, second_out) = self._moments
        g = self._scratch
        _copy_into(g, fresh)
        torch.lerp(first.data, g.data, 1.0 - beta1, out=first_out.data)
        torch.mul(second.data, beta2, out=second_out.data)
        second_out.data.addcmul_(g.data, g.data, value=1.0 - beta2)
        t = step + 1  # Adam's bias correction counts from 1
        denominator = torch.div(second_out.data, 1.0 - beta2**t, out=g.data).sqrt_().add_(eps)
        committed, working = self._residual
        if working is not committed:
            working.data.copy_(committed.data)
        working.data.addcdiv_(first_out.data, denominator, value=1.0 / (1.0 - beta1**t))


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


def check_adam(adam: Sequence[float]) -> tuple[float, float, float]:
    """``adam`` as (β₁, β₂, ε) with β in [0, 1) and ε > 0, or raise naming the option."""
    try:
        beta1, beta2, eps = (float(x) for x in adam)
    except (TypeError, ValueError):
        raise TypeError(
            f"adam_correction must be (beta1, beta2, eps), e.g. (0.9, 0.999, 1e-8); got {adam!r}"
        ) from None
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and eps > 0.0):
        raise ValueError(
            f"adam_correction must be (beta1, beta2, eps) with betas in [0, 1) and eps > 0, "
            f"got {adam!r}"
        )
    return beta1, beta2, eps


def _copy_into(target: FlatVector, fresh: Fresh) -> None:
    """target ← fresh in one pass; ``None`` counts as 0."""
    if isinstance(fresh, torch.Tensor):
        target.data.copy_(fresh.view(-1))
        return
    for view, g in zip(target.views, fresh):
        if g is None:
            view.zero_()
        else:
            view.copy_(g)


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
