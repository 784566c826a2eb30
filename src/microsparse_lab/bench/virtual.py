"""n virtual workers in one process, each running the engine's step with its own residual.

Every worker r holds a sparsifier from the registry bound with ``bind(layout, r, n)``, its own
error-feedback residual and a :class:`~microsparse.engine.SparseStep`. One
:meth:`VirtualCluster.step` runs the very protocol ``GradientReducer.synchronize`` runs, for
every worker together (:func:`~microsparse.comm.run_together`): the collectives are
combined in process, so every worker's selection, index message, capacity cut, union and
forgetting are the library's own code, not a restatement of it. The averaged gradient itself
is not written anywhere (nothing trains here).

Memory: one d-long residual per worker, plus each sparsifier's own buffers (a whole-vector
sparsifier keeps d floats and d bools per worker). A worker's gradient is made on the fly
(``gradient_for(rank)``), never stored. A union exchange (``Padded(union=True)``) is
deduplicated once per step for all workers (:class:`SharedUnion`): on a cluster every rank
sorts the n gathered messages once, here n workers in one process would sort them n times.

Example:
    >>> import torch
    >>> from microsparse_lab.bench.workload import model_layout
    >>> cluster = VirtualCluster("micro", 0.01, model_layout(10_000), world_size=4)
    >>> record = cluster.step(lambda rank, out: torch.randn(10_000, out=out))
    >>> record.selected == sum(record.counts) == record.target   # exclusive: no build-up
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from microsparse.comm import (
    Exchange,
    Exchanged,
    Framing,
    Kind,
    Padded,
    Proposal,
    index_dtype,
    run_together,
)
from microsparse.engine import DiscardOutput, SparseStep, StepReport, resolve
from microsparse.feedback import ErrorFeedback
from microsparse.layout import Layout
from microsparse.sparsifiers import create_sparsifier
from microsparse_lab.bench.settle import bisect_threshold, kth_magnitude
from microsparse_lab.bench.timing import choose_clock

GradientSource = Callable[[int, torch.Tensor], torch.Tensor]
"""``gradient_for(rank, out)``: write worker ``rank``'s fresh gradient into ``out``."""


@dataclass(frozen=True)
class StepRecord:
    """What one step of the virtual cluster selected and sent."""

    step: int
    selected: int  # K: distinct positions averaged
    target: int  # k
    counts: list[int]  # k_r: positions each worker sent
    select_seconds: list[float]  # per worker: its local work up to selection (a plan included)
    agreement_bytes: int  # per rank, the summed agreement vector (0 if none)
    plan_bytes: int  # the broadcast plan (planned sparsifiers), else 0
    index_bytes: int  # width of one index on the wire
    exchange: str  # the framing's label
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
        self.engines: list[SparseStep] = []
        for rank in range(world_size):
            sparsifier = create_sparsifier(name, density, **options)
            sparsifier.bind(layout, rank, world_size)
            feedback = ErrorFeedback(layout, torch.float32, self.device)
            self.engines.append(SparseStep(sparsifier, feedback))
        union: dict[str, Any] = {}  # one per cluster: the last step's rows and their union
        for engine in self.engines:
            # A fixed union decodes at known counts, deduplicating nothing: left as it is.
            if type(engine.framing) is Padded and engine.framing.union:
                engine.framing = SharedUnion(engine.framing, union)
        self.exchange = self.engines[0].framing.label
        self.target = self.engines[0].sparsifier.target
        self._fresh = torch.empty(layout.numel, device=self.device)
        self._output = DiscardOutput()
        self.step_index = 0
        self.clock = choose_clock(self.device)

    @property
    def sparsifiers(self) -> list[Any]:
        return [engine.sparsifier for engine in self.engines]

    def residual(self, rank: int) -> torch.Tensor:
        return self.engines[rank].feedback.accumulated

    def step(self, gradient_for: GradientSource) -> StepRecord:
        """One synchronisation step of every worker; see the module docstring."""
        t, numel = self.step_index, self.layout.numel
        if self.exchange == "dense":
            self.step_index += 1
            everything = [numel] * self.world_size
            return StepRecord(t, numel, numel, everything, [0.0] * self.world_size, 0, 0, 0,
                              "dense", 0, everything)  # fmt: skip
        reports: list[StepReport] = run_together(
            [self._protocol(rank, t, gradient_for) for rank in range(self.world_size)]
        )
        self.step_index += 1
        first = reports[0]
        width = torch.empty(0, dtype=index_dtype(numel)).element_size()
        return StepRecord(
            t, resolve(first.selected), self.target, [r.local_selected for r in reports],
            [r.select_seconds for r in reports], first.message_bytes.get("agreement", 0),
            first.message_bytes.get("plan", 0), width, self.exchange, first.message_slots,
            [r.local_proposed for r in reports],
        )  # fmt: skip

    def _protocol(self, rank: int, step: int, gradient_for: GradientSource) -> Generator:
        # The ranks share one gradient buffer, and run_together starts them one after the
        # other: rank r's gradient is written into it before its step reads it, for the guard
        # (up to its first request) and again for compensation and selection (up to its
        # second). Later rounds read only the rank's own residual.
        def protocol() -> Generator:
            inner = self.engines[rank].run(step, gradient_for(rank, self._fresh), self._output)
            request = next(inner)
            for round_ in itertools.count():
                result = yield request
                if round_ == 0:
                    gradient_for(rank, self._fresh)
                try:
                    request = inner.send(result)
                except StopIteration as done:
                    return done.value

        return protocol()

    def accumulate(self, gradient_for: GradientSource) -> None:
        """Add every worker's fresh gradient to its residual (error feedback)."""
        for rank, engine in enumerate(self.engines):
            engine.feedback.compensate(gradient_for(rank, self._fresh))

    def settle(self, gradient_for: GradientSource) -> bool:
        """Accumulate this step's gradients and set adaptive thresholds so that it selects k.

        The next :meth:`step` must then be called with a source that adds nothing new for
        this step (``settle`` already added it): pass ``zero_gradient``. Only sparsifiers that
        carry a threshold from step to step take one (:meth:`Sparsifier.settle`): one λ for
        all workers when they select in exclusive partitions (the count over all workers'
        owned entries is k, found by bisection through their own ``select``), else each
        worker's own k-th largest |a|. Returns whether anything was set.
        """
        self.accumulate(gradient_for)
        first = self.engines[0].sparsifier
        if not first.settle(first.threshold if math.isfinite(first.threshold) else 1.0):
            return False
        t, k = self.step_index, self.target
        if self.exchange in ("fixed", "padded"):

            def count(threshold: float) -> int:
                selected = 0
                for rank, engine in enumerate(self.engines):
                    engine.sparsifier.settle(threshold)
                    selected += engine.sparsifier.select(self.residual(rank), t).numel()
                return selected

            high = max(self.residual(r).abs().max().item() for r in range(self.world_size))
            _, high = bisect_threshold(count, k, high * 1e-8, high, rounds=48)
            for engine in self.engines:
                engine.sparsifier.settle(high)
        else:
            for rank, engine in enumerate(self.engines):
                engine.sparsifier.settle(kth_magnitude(self.residual(rank), k))
        return True


class SharedUnion(Framing):
    """A ``Padded(union=True)`` framing whose union is computed once per step for all workers.

    :func:`~microsparse.comm.run_together` answers an all-gather with one and the same
    tensor for every worker, so every worker would decode and deduplicate the very same rows
    into the very same positions: O(n · n·k_r log) per step for n workers instead of a
    cluster rank's O(n·k_r log). The first worker's own framing computes the union; the
    others take it (positions are only read), with their own counts.
    """

    name = Padded.name

    def __init__(self, inner: Padded, shared: dict[str, Any]) -> None:
        self.inner = inner
        self.label = inner.label
        self._shared = shared

    def exchange(self, proposal: Proposal, world_size: int) -> Exchange:
        protocol = self.inner.exchange(proposal, world_size)
        request = next(protocol)
        while True:
            answer = yield request
            if request.what == "indices" and self._shared.get("rows") is answer:
                protocol.close()
                done: Exchanged = self._shared["exchanged"]
                mine = proposal.local.numel()
                return dataclasses.replace(done, local_selected=mine, local_proposed=mine)
            try:
                request = protocol.send(answer)
            except StopIteration as finished:
                if request.what == "indices":
                    self._shared.update(rows=answer, exchanged=finished.value)
                return finished.value

    @classmethod
    def collectives(
        cls, slots: float, index_bytes: int, counts_known: bool = False
    ) -> list[tuple[Kind, float]]:
        return Padded.collectives(slots, index_bytes, counts_known)


def zero_gradient(rank: int, out: torch.Tensor) -> torch.Tensor:
    """A gradient source that adds nothing (see :meth:`VirtualCluster.settle`)."""
    return out.zero_()
