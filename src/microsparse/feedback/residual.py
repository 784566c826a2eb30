"""Error feedback: nothing that is not sent is lost, only delayed.

One flat vector holds the residual e between steps. ``compensate`` adds the fresh gradients
into it (a = e + g, no copy of the gradients), selection and exchange read a, and ``forget``
zeroes every position whose value was sent, which leaves the new residual.

A step can be *skipped* without the host looking: ``compensate`` and ``forget`` take a
``skip`` flag, a one-element float32 tensor on the device that is 1 when any rank's gradient
held a NaN or Inf (or the ranks disagreed), and then leave every buffer exactly as it was.
The adds are torch's fused optimiser kernels, which read the flag on the device and do
nothing when it is set, so a skipped step costs no extra pass and no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        >>> memory.residual.tolist()           # the residual keeps the rest
        [1.0, -2.0, 0.0, 0.5]
        >>> skip = torch.ones(1)               # a skipped step changes nothing
        >>> memory.compensate([torch.tensor([float("nan"), 1.0, 1.0, 1.0])], skip=skip)
        >>> memory.residual.tolist()
        [1.0, -2.0, 0.0, 0.5]
    """

    def __init__(
        self,
        layout: Layout,
        dtype: torch.dtype,
        device: torch.device,
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
        self._residual = FlatVector(layout, dtype, device)
        self._offsets = layout.offsets
        self._velocity = FlatVector(layout, dtype, device) if self.momentum else None
        self._moments = (
            (FlatVector(layout, dtype, device), FlatVector(layout, dtype, device))
            if self.adam else None
        )  # fmt: skip
        # Adam's step count, as its fused kernel reads it: a tensor, written without a sync.
        self._adam_step = torch.zeros((), dtype=torch.float32, device=device)

    @property
    def accumulated(self) -> torch.Tensor:
        """a of the step in progress (between ``compensate`` and ``forget``), else e."""
        return self._residual.data

    @property
    def residual(self) -> torch.Tensor:
        """e: the residual (a while a step is in progress)."""
        return self._residual.data

    @property
    def velocity(self) -> torch.Tensor | None:
        """u with momentum correction, else None."""
        return None if self._velocity is None else self._velocity.data

    @property
    def moments(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(m, v) with Adam correction, else None."""
        if self._moments is None:
            return None
        return self._moments[0].data, self._moments[1].data

    @property
    def buffers(self) -> list[FlatVector]:
        """What a worker carries between steps: e, then u with momentum correction, or m and
        v with Adam correction."""
        extra = [] if self._velocity is None else [self._velocity]
        if self._moments is not None:
            extra = list(self._moments)
        return [self._residual, *extra]

    @property
    def views(self) -> list[torch.Tensor]:
        """:attr:`residual` shaped like each parameter."""
        return self._residual.views

    def compensate(
        self,
        fresh: Fresh,
        step: int = 0,
        skip: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ) -> None:
        """a ← e + g, or with momentum correction u ← m·u + g and a ← e + u (Nesterov:
        e + g + m·u), or with Adam correction a ← e + Adam's step number ``step`` (from 0).
        A missing gradient (unused parameter) counts as zero.

        ``skip``: a one-element float32 tensor; where it holds 1 nothing changes (a NaN or Inf
        in ``fresh`` included). ``scale``: a one-element float32 tensor the gradients are
        divided by first (a ``GradScaler``'s scale, so that the residual holds unscaled
        gradients). The fresh gradients themselves may be overwritten.
        """
        index, gradients = self._fresh(fresh)
        if not gradients:
            return
        residual = _pick(self._residual, index)
        if self._moments is not None:
            beta1, beta2, eps = self.adam  # type: ignore[misc]
            first, second = self._moments
            self._adam_step.fill_(step + 1)  # Adam's bias correction counts from 1
            torch._fused_adam_(
                residual, gradients, _pick(first, index), _pick(second, index), [],
                [self._adam_step] * len(gradients), lr=-1.0, beta1=beta1, beta2=beta2,
                weight_decay=0.0, eps=eps, amsgrad=False, maximize=False, grad_scale=scale,
                found_inf=skip,
            )  # fmt: skip
            return
        velocity = [] if self._velocity is None else _pick(self._velocity, index)
        # An SGD step param ← param − lr·(g + …) with lr = −1 is the add a ← e + g (e + u with
        # a velocity); the fused kernel reads the flag on the device and skips the step.
        torch._fused_sgd_(
            residual, gradients, velocity, weight_decay=0.0, momentum=self.momentum, lr=-1.0,
            dampening=0.0, nesterov=self.nesterov, maximize=False, is_first_step=False,
            grad_scale=scale, found_inf=skip,
        )  # fmt: skip

    def _fresh(self, fresh: Fresh) -> tuple[list[int] | None, list[torch.Tensor]]:
        """The parameters that have a gradient (None: the whole flat vector) and those
        gradients, each in its residual's dtype and layout, as the fused kernels want them."""
        views = self._residual.views
        if isinstance(fresh, torch.Tensor):
            flat = _like(fresh.reshape(-1), self._residual.data)
            if not (self.momentum or self.adam):
                return None, [flat]
            # Per parameter, as from a list: the fused kernels' vectorised and scalar parts
            # round a multiply-add differently, so the split must not depend on the driver.
            fresh = [flat[o : o + v.numel()].view_as(v) for o, v in zip(self._offsets, views)]
        if self.momentum or self.adam:  # a missing gradient still moves u, or m and v
            return list(range(len(views))), [
                torch.zeros_like(view) if g is None else _like(g, view)
                for view, g in zip(views, fresh)
            ]
        index = [i for i, g in enumerate(fresh) if g is not None]
        return index, [_like(fresh[i], views[i]) for i in index]  # type: ignore[arg-type]

    def forget(self, sent: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        """e ← a with every sent position zeroed, or set to ``kept`` (what rounding the sent
        values left behind; on a skipped step, the values themselves): O(K), no dense pass."""
        if kept is None:
            self.accumulated.index_fill_(0, sent, 0)
        else:
            self.accumulated.index_copy_(0, sent, kept)

    def mask_velocity(self, sent: torch.Tensor, skip: torch.Tensor | None = None) -> None:
        """Momentum factor masking: u ← 0 at the sent positions, unless the step is skipped
        (``skip``, a one-element bool tensor, holds True)."""
        if self._velocity is None:
            return
        velocity = self._velocity.data
        if skip is None:
            velocity.index_fill_(0, sent, 0)
        else:
            velocity.index_copy_(0, sent, torch.where(skip, velocity.index_select(0, sent), 0.0))


def _pick(buffer: FlatVector, index: list[int] | None) -> list[torch.Tensor]:
    """The whole flat vector (``index`` None), or the views of the parameters in ``index``."""
    return [buffer.data] if index is None else [buffer.views[i] for i in index]


def _like(gradient: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``gradient`` in ``target``'s dtype and layout (a copy only when they differ)."""
    if gradient.dtype != target.dtype or gradient.stride() != target.stride():
        return gradient.to(target.dtype, memory_format=torch.contiguous_format)
    return gradient


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


def flag_nonfinite(fresh: Fresh, flag: torch.Tensor, cleared: bool = False) -> torch.Tensor:
    """Set ``flag`` (one-element float32) to 1 if a gradient in ``fresh`` holds a NaN or Inf,
    else to 0: one fused read pass over every gradient, no host synchronisation. With
    ``cleared`` the caller has already written 0 there (one kernel less).

    Example:
        >>> flag = torch.zeros(1)
        >>> flag_nonfinite([torch.ones(3), None, torch.tensor([1.0, float("nan")])], flag)
        tensor([1.])
    """
    if not cleared:
        flag.zero_()
    gradients = [fresh] if isinstance(fresh, torch.Tensor) else [g for g in fresh if g is not None]
    one = _ones.get(flag.device)
    if one is None:
        one = _ones[flag.device] = torch.ones((), dtype=torch.float32, device=flag.device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in gradients:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():  # AMP's check: sets the flag, multiplies by one
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, one)
    return flag


_ones: dict[torch.device, torch.Tensor] = {}


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
