"""Each step's numbers kept where they are made, read on the host every N steps.

On a GPU every read of a device number (the loss, a step statistic, a time) makes the host
wait until the device has run everything queued before it, so the backward pass of the next
step cannot be queued ahead. :class:`PendingSteps` keeps each step's loss as a device tensor,
its :class:`~microsparse.StepStats` unread and its times as CUDA events, and reads them all at
once every ``every`` steps: one all-reduce of the losses and one wait, instead of one a step.
On the CPU nothing waits; the times are the host's clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from microsparse.engine import mark, seconds_between
from microsparse.stats import StepStats
from microsparse_lab.training.log import RunLog


class TrainingDiverged(FloatingPointError):
    """The loss or the gradient of a step was not finite on some rank."""


@dataclass
class _Step:
    step: int
    epoch: int
    loss: torch.Tensor
    lr: float
    marks: tuple[Any, Any, Any]
    stats: StepStats


class PendingSteps:
    """The steps since the last read, read together (on every rank: the losses' all-reduce is
    a collective) by :meth:`read`.

    ``check_finite``: raise :class:`TrainingDiverged` on every rank at the first step whose
    mean loss was not finite or whose exchange was skipped for a non-finite gradient (the
    library's ``nonfinite="skip"``, which needs no host read during the step).

    Example (the loop of :func:`microsparse_lab.training.loop.train`)::

        pending = PendingSteps(every=20, device=torch.device("cuda"), log=log)
        for step in range(steps):
            start = pending.mark()
            loss = model(batch)
            loss.backward()  # and the exchange, in DDP's hook
            backward = pending.mark()
            stats = averaging.synchronize()
            optimizer.step()
            pending.add(step, epoch, loss, lr, (start, backward, pending.mark()), stats)
        pending.read()  # the last steps, before evaluating or saving a checkpoint
    """

    def __init__(
        self, every: int, device: torch.device, log: RunLog | None, check_finite: bool = False
    ) -> None:
        self.every = every
        self._device = device
        self._log = log
        self._check_finite = check_finite
        self._steps: list[_Step] = []

    def mark(self) -> Any:
        """Now, on the host's clock, or as a CUDA event in the current stream (no wait)."""
        return mark(self._device)

    def add(
        self,
        step: int,
        epoch: int,
        loss: torch.Tensor,
        lr: float,
        marks: tuple[Any, Any, Any],
        stats: StepStats,
    ) -> None:
        """Keep a finished step: (start, after backward, end) ``marks`` from :meth:`mark`;
        read them when ``every`` steps are kept."""
        self._steps.append(_Step(step, epoch, loss.detach(), lr, marks, stats))
        if len(self._steps) >= self.every:
            self.read()

    def read(self) -> None:
        """Read the kept steps (every rank must call it at the same step) and log them."""
        if not self._steps:
            return
        steps, self._steps = self._steps, []
        losses = torch.stack([s.loss.float() for s in steps])
        dist.all_reduce(losses, op=dist.ReduceOp.SUM)
        means = [value / dist.get_world_size() for value in losses.tolist()]
        for kept, loss in zip(steps, means):
            if self._check_finite and (not math.isfinite(loss) or kept.stats.skipped):
                raise TrainingDiverged(
                    f"step {kept.step}: the "
                    + ("loss" if not math.isfinite(loss) else "gradient")
                    + " was not finite on some rank (training diverged); lower --lr, or "
                    "clip the gradient with --clip"
                )
            if self._log is not None:
                start, backward, end = kept.marks
                self._log.step(kept.step, kept.epoch, loss, kept.lr,
                               seconds_between(start, backward), seconds_between(start, end),
                               kept.stats)  # fmt: skip
