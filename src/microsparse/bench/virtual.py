"""n virtual workers in one process, each with its own sparsifier and residual.

Every worker r holds a sparsifier from the registry bound with ``bind(layout, r, n)`` and an
error-feedback residual. One :meth:`VirtualCluster.step` runs the reducer's protocol across
the workers with in-process sums instead of collectives: each worker adds its gradient to its
residual; the ranks' ``agreement`` vectors are summed and adopted (or the leader's plan is
made and adopted), every worker selects with its own sparsifier, the selections combine as
the sparsifier's ``exchange`` says (concatenated, cut to the fixed capacity keeping the
largest |a| as the reducer does, deduplicated, shared, dense), every sparsifier sees the
global count, and every worker forgets all sent positions.

Memory: one n × d float32 residual matrix, plus each sparsifier's own buffers (a whole-vector
sparsifier keeps d floats and d bools per worker). A worker's gradient is made on the fly
(``gradient_for(rank)``), never stored.

Example:
    >>> import torch
    >>> from microsparse.bench.workload import model_layout
    >>> cluster = VirtualCluster("micro", 0.01, model_layout(10_000), world_size=4)
    >>> record = cluster.step(lambda rank, out: torch.randn(10_000, out=out))
    >>> record.selected == sum(record.counts)   # exclusive: no build-up
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from microsparse.bench.timing import CLOCKS, choose_clock
from microsparse.comm.collectives import index_dtype
from microsparse.layout import Layout
from microsparse.sparsifiers import Sparsifier, create_sparsifier

GradientSource = Callable[[int, torch.Tensor], torch.Tensor]
"""``gradient_for(rank, out)``: write worker ``rank``'s fresh gradient into ``out``."""


@dataclass(frozen=True)
class StepRecord:
    """What one step of the virtual cluster selected and sent."""

    step: int
    selected: int  # K: distinct positions averaged
    target: int  # k
    counts: list[int]  # k_r: positions each worker sent
    select_seconds: list[float]  # per worker: agreement + select (and the plan on the leader)
    plan_seconds: float  # the leader's plan (planned sparsifiers), else 0
    agreement_bytes: int  # per rank, the summed agreement vector (0 if none)
    plan_bytes: int  # the broadcast plan (planned sparsifiers), else 0
    index_bytes: int  # width of one index on the wire
    exchange: str
    message_slots: int  # indices per rank's index message: max k_r, or the fixed capacity
    proposals: list[int]  # positions each worker selected (> counts when capacity cut them)

    @property
    def proposed(self) -> int:
        return sum(self.proposals)

    @property
    def max_local_selected(self) -> int:
        return self.message_slots


class VirtualCluster:
    """``world_size`` workers running sparsifier ``name`` on one ``layout``."""

    def __init__(
        self,
        name: str,
        density: float,
        layout: Layout,
        world_size: int,
        device: torch.device | str = "cpu",
        **options: Any,
    ) -> None:
        self.layout = layout
        self.world_size = world_size
        self.device = torch.device(device)
        self.sparsifiers: list[Sparsifier] = []
        for rank in range(world_size):
            sparsifier = create_sparsifier(name, density, **options)
            sparsifier.bind(layout, rank, world_size)
            self.sparsifiers.append(sparsifier)
        self.exchange = self.sparsifiers[0].exchange
        self.target = self.sparsifiers[0].target
        rows = 0 if self.exchange == "dense" else world_size
        self.residuals = torch.zeros(rows, layout.numel, device=self.device)
        self._fresh = torch.empty(layout.numel, device=self.device)
        self.step_index = 0
        self.clock = choose_clock(self.device)
        self._now = CLOCKS[self.clock]

    def accumulate(self, gradient_for: GradientSource) -> None:
        """Add every worker's fresh gradient to its residual (error feedback)."""
        for rank in range(self.residuals.shape[0]):
            self.residuals[rank].add_(gradient_for(rank, self._fresh))

    def step(self, gradient_for: GradientSource) -> StepRecord:
        """One synchronisation step of every worker; see the module docstring."""
        t, n, numel = self.step_index, self.world_size, self.layout.numel
        if self.exchange == "dense":
            self.step_index += 1
            everything = [numel] * n
            return StepRecord(
                t, numel, numel, everything, [0.0] * n, 0.0, 0, 0, 0, "dense", 0, everything
            )
        self.accumulate(gradient_for)
        picks, seconds, plan_seconds, agreement_bytes, plan_bytes = self._select(t)
        proposals = [p.numel() for p in picks]
        slots = max(proposals)
        if self.exchange == "fixed":  # as the reducer: keep the largest |a| up to capacity
            slots = self.sparsifiers[0].capacity
            picks = [self._within_capacity(rank, p, slots) for rank, p in enumerate(picks)]
        if self.exchange in ("exclusive", "fixed"):
            positions = torch.cat(picks)
        elif self.exchange == "union":
            positions = torch.unique(torch.cat(picks))
        else:  # shared: every worker selected the same positions
            positions, slots = picks[0], 0
        for sparsifier in self.sparsifiers:
            sparsifier.update(positions.numel())
        self.residuals.index_fill_(1, positions, 0)
        self.step_index += 1
        width = torch.empty(0, dtype=index_dtype(numel)).element_size()
        return StepRecord(
            t, positions.numel(), self.target, [p.numel() for p in picks], seconds,
            plan_seconds, agreement_bytes, plan_bytes, width, self.exchange, slots, proposals,
        )  # fmt: skip

    def _within_capacity(self, rank: int, picks: torch.Tensor, capacity: int) -> torch.Tensor:
        if picks.numel() <= capacity:
            return picks
        magnitude = self.residuals[rank].index_select(0, picks).abs_()
        return picks.index_select(0, torch.topk(magnitude, capacity).indices)

    def _select(self, t: int) -> tuple[list[torch.Tensor], list[float], float, int, int]:
        seconds = [0.0] * self.world_size
        plan_seconds, agreement_bytes, plan_bytes = 0.0, 0, 0
        first = self.sparsifiers[0]
        if first.planned:
            leader = first.leader(t)
            started = self._now()
            plan = self.sparsifiers[leader].make_plan(self.residuals[leader], t)
            plan_seconds = self._now() - started
            plan_bytes = plan.numel() * plan.element_size()
            for sparsifier in self.sparsifiers:
                sparsifier.adopt_plan(plan.clone(), t)
        else:
            proposals = []
            for rank, sparsifier in enumerate(self.sparsifiers):
                started = self._now()
                proposals.append(sparsifier.agreement(self.residuals[rank], t))
                seconds[rank] += self._now() - started
            if proposals[0] is not None:
                total = torch.stack(proposals).sum(dim=0)
                agreement_bytes = total.numel() * total.element_size()
                for sparsifier in self.sparsifiers:
                    sparsifier.adopt_agreement(total.clone())
        picks = []
        for rank, sparsifier in enumerate(self.sparsifiers):
            started = self._now()
            picks.append(sparsifier.select(self.residuals[rank], t))
            seconds[rank] += self._now() - started
        if first.planned:
            seconds = [s + plan_seconds for s in seconds]  # every worker waits for the plan
        return picks, seconds, plan_seconds, agreement_bytes, plan_bytes

    def settle(self, gradient_for: GradientSource) -> bool:
        """Accumulate this step's gradients and set adaptive thresholds so that it selects k.

        The next :meth:`step` must then be called with a source that adds nothing new for
        this step (``settle`` already added it): pass ``zero_gradient``. Sparsifiers whose
        state holds a ``threshold``: one λ for all workers (``exclusive``: the count over all
        workers' owned entries is k, found by bisection through their own ``select``) or
        each worker's own k-th largest |a| (``union``). Returns whether anything was set.
        """
        states = [s.state_dict() for s in self.sparsifiers]
        if self.exchange == "dense" or "threshold" not in states[0]:
            self.accumulate(gradient_for)
            return False
        self.accumulate(gradient_for)
        t, k = self.step_index, self.target
        if self.exchange == "exclusive":
            high = self.residuals.abs().max().item()
            low = high * 1e-8
            for _ in range(48):
                middle = math.sqrt(low * high)
                self._set_thresholds(states, [middle] * self.world_size)
                count = sum(
                    s.select(self.residuals[r], t).numel() for r, s in enumerate(self.sparsifiers)
                )
                low, high = (middle, high) if count > k else (low, middle)
            self._set_thresholds(states, [high] * self.world_size)
        else:
            thresholds = [
                self.residuals[r].abs().topk(min(k, self.layout.numel)).values[-1].item()
                for r in range(self.world_size)
            ]
            self._set_thresholds(states, thresholds)
        return True

    def _set_thresholds(self, states: list[dict[str, Any]], thresholds: list[float]) -> None:
        for sparsifier, state, threshold in zip(self.sparsifiers, states, thresholds):
            sparsifier.load_state_dict({**state, "threshold": threshold})


def zero_gradient(rank: int, out: torch.Tensor) -> torch.Tensor:
    """A gradient source that adds nothing (see :meth:`VirtualCluster.settle`)."""
    return out.zero_()
