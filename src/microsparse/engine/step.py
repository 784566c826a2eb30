"""One sparse averaging step over one slab, written once for every driver.

A *slab* is a flat vector of parameters (the whole model for ``GradientReducer``, one group
of DDP's buckets for the hook) with its error-feedback residual. :meth:`SparseStep.run` is the
whole protocol of one step, top to bottom:

1. **compensate**: add the fresh gradients into the residual in place, a = e + g;
2. **pre-selection round**, if the sparsifier asks for one: a leader's plan (header check,
   then a broadcast) or an all-ranks sum such as MiCRO's threshold histogram;
3. **select**: the sparsifier proposes this rank's positions;
4. **index exchange**: the sparsifier's framing (``microsparse.comm.framing``) makes every
   rank learn all positions, checking that every rank is at the same step;
5. **values**: gather a at those positions (rounded to the wire dtype if asked, the rounding
   kept in the residual), forget them locally (the new residual), all-reduce;
6. **finish**: check the sum is finite (a NaN or Inf that any rank sent shows in it on every
   rank), divide by n, write the sparse average, tell the sparsifier the global count.

The driver then commits the step (:meth:`~SparseStep.commit`), or rolls it back
(:meth:`~SparseStep.rollback`) after an error. With a transactional residual
(``ErrorFeedback(..., transactional=True)``) a rolled-back step leaves no trace, and every
entry is checked, not only those sent: each rank adds one slot to the values it all-reduces,
NaN if its accumulated gradient holds a NaN or Inf anywhere, so that every rank sees any
rank's non-finite gradient in the same sum.

It never calls ``torch.distributed``. It *yields* each collective as a
:class:`~microsparse.comm.Collective` request and is sent the result, so one protocol serves
a blocking driver (:func:`run_blocking`, used by ``GradientReducer``), a future-chain driver
(the DDP hook) and in-process drivers (the simulator and the benchmarks).

Example:
    >>> import torch
    >>> from microsparse.comm import ProcessGroupCollectives
    >>> from microsparse.engine.output import FlatOutput
    >>> from microsparse.feedback import ErrorFeedback
    >>> from microsparse.layout import Layout
    >>> from microsparse.sparsifiers import create_sparsifier
    >>> layout = Layout.of([("w", torch.zeros(1000))])
    >>> sparsifier = create_sparsifier("micro", 0.01)
    >>> sparsifier.bind(layout, rank=0, world_size=1)
    >>> engine = SparseStep(sparsifier, ErrorFeedback(layout, torch.float32, torch.device("cpu")))
    >>> gradient, output = torch.randn(1000), FlatOutput(torch.zeros(1000))
    >>> report = run_blocking(engine.run(0, gradient, output), ProcessGroupCollectives())
    >>> report.selected, int((output.data != 0).sum())   # the 10 largest were sent
    (10, 10)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from microsparse.comm.collectives import Collective, Collectives, check_steps
from microsparse.comm.framing import Dense, Fixed, Proposal, Shared
from microsparse.errors import NonFiniteGradientError
from microsparse.feedback import ErrorFeedback, Fresh, any_nonfinite
from microsparse.sparsifiers import Sparsifier

Protocol_ = Generator[Collective, torch.Tensor, "StepReport"]


class Output(Protocol):
    """Where a step writes the averaged gradient (``microsparse.engine.output``)."""

    def write(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Make the output the sparse vector with ``values`` at ``positions``, zero elsewhere."""

    def dense(self, fresh: Fresh) -> torch.Tensor:
        """The fresh gradient as one flat tensor that *is* the output (averaged in place)."""


@dataclass
class StepReport:
    """What one step of one slab selected, sent and cost (local times only)."""

    selected: int
    local_selected: int
    message_slots: int
    proposed: int
    bytes_sent: int
    threshold: float
    select_seconds: float
    """Local work up to the end of selection (compensation, plan or agreement, selection)."""
    finish_seconds: float
    """Local work after selection (framing, decoding, gathering, writing), no waiting."""
    extra: dict[str, Any] = field(default_factory=dict)
    partition: tuple[int, int] | None = None
    local_proposed: int = 0
    """This rank's proposals before a fixed message's capacity cut them."""
    message_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of this rank's message in each kind of request (``Collective.what``)."""


class SparseStep:
    """The protocol of one step over one slab; see the module docstring.

    Args:
        sparsifier: a registry sparsifier, already bound to the slab's layout.
        feedback: the slab's residual.
        value_dtype: send the selected values as this dtype (``torch.float16`` or
            ``torch.bfloat16``); each rank's rounding error stays in its residual.
        schedule: k of each step (a density warm-up), if it is not the sparsifier's k.
    """

    def __init__(
        self,
        sparsifier: Sparsifier,
        feedback: ErrorFeedback,
        value_dtype: torch.dtype | None = None,
        schedule: Callable[[int], int] | None = None,
    ) -> None:
        self.sparsifier = sparsifier
        self.framing = sparsifier.framing()
        self.schedule = schedule
        if isinstance(self.framing, Dense) and schedule is not None:
            raise ValueError(
                "density_warmup needs a sparsifier that selects, but this one averages densely "
                "(dense, or density 1): leave density_warmup unset"
            )
        if isinstance(self.framing, Dense) and feedback.adam:
            raise ValueError(
                "adam_correction needs error feedback, but this sparsifier averages densely "
                "(dense, or density 1): leave adam_correction unset and keep the optimiser's Adam"
            )
        if isinstance(self.framing, Dense) and feedback.momentum:
            raise ValueError(
                "momentum_correction needs error feedback, but this sparsifier averages densely "
                "(dense, or density 1): leave momentum_correction at 0 and keep the optimiser's "
                "momentum"
            )
        self.feedback = feedback
        self.value_dtype = value_dtype
        self.rank = sparsifier.rank
        self.world_size = sparsifier.world_size

    def run(
        self,
        step: int,
        fresh: Fresh,
        output: Output,
        exclude: Sequence[tuple[int, int]] = (),
    ) -> Protocol_:
        """The requests of step ``step``; returns its :class:`StepReport`.

        ``fresh`` is the slab's gradient (flat, or per parameter with ``None`` for none).
        ``exclude`` lists ranges [start, end) of the slab that this rank did not use (DDP
        drops the average of a parameter that no rank used). This rank proposes nothing
        there; where a leader's plan (CLT-k, DEFT) or the oracle's sum fixes the positions,
        it sends 0 at those inside the ranges and keeps its residual there.
        """
        self._snapshot = self.sparsifier.state_dict()
        if isinstance(self.framing, Dense):
            return (yield from self._dense(step, fresh, output))
        if self.schedule is not None:
            self._follow_schedule(step)
        clock = _Clock()
        sparsifier = self.sparsifier
        self.feedback.compensate(fresh, step)
        accumulated = self.feedback.accumulated
        counts = yield from clock.local(self._pre_selection(accumulated, step))
        local = sparsifier.select(accumulated, step)
        # A leader's plan or the oracle's sum fixes what every rank sends: a rank cannot leave
        # out the parameters it did not use there, so it sends 0 at them instead (below).
        fixed = counts is not None or isinstance(self.framing, Shared)
        if exclude and not fixed:
            local = local[~_inside(local, exclude)]
        if counts is not None and local.numel() != counts[self.rank]:
            raise RuntimeError(
                f"{sparsifier.name}: rank {self.rank} selected {local.numel()} positions but "
                f"its plan says {counts[self.rank]} (a sparsifier bug)"
            )
        threshold, extra = sparsifier.threshold, sparsifier.report()
        select_seconds = clock.lap()
        proposal = Proposal(local, accumulated, step, counts)
        exchanged = yield from clock.local(self.framing.exchange(proposal, self.world_size))
        positions = exchanged.positions
        # If no rank used a parameter, DDP drops its average: what was sent there would be lost.
        unused = _inside(positions, exclude) if exclude and fixed else None
        values = self._values(positions, unused)
        # Known before the sum overwrites them; read only if the sum is not finite.
        mine = values.numel() > 0 and any_nonfinite(values)
        if self.feedback.transactional:  # anything non-finite anywhere fails every rank
            anywhere = any_nonfinite(accumulated)
            mine = anywhere
            flag = torch.where(anywhere, math.nan, 0.0).to(values.dtype).reshape(1)
            values = torch.cat([values, flag])
        summed = yield from clock.local(_single(Collective("all_reduce", values, "values")))
        if summed.numel() and bool(any_nonfinite(summed)):
            raise self._nonfinite(step, positions, summed[: positions.numel()], bool(mine))
        summed = summed[: positions.numel()]
        averaged = summed.to(accumulated.dtype) if self.value_dtype else summed
        output.write(positions, averaged.div_(self.world_size))
        sparsifier.update(positions.numel())
        return StepReport(
            selected=positions.numel(),
            local_selected=exchanged.local_selected,
            message_slots=exchanged.message_slots,
            proposed=exchanged.proposed,
            bytes_sent=clock.bytes(self.world_size),
            threshold=threshold,
            select_seconds=select_seconds,
            finish_seconds=clock.lap(),
            extra=extra,
            partition=sparsifier.partition(step),
            local_proposed=exchanged.local_proposed,
            message_bytes=clock.message_bytes(),
        )

    def _follow_schedule(self, step: int) -> None:
        """Move k to the schedule's for ``step`` (a function of the step alone, so that a
        resumed or rolled-back run finds the same k); the index message follows."""
        target = self.schedule(step)
        if target != self.sparsifier.target:
            self.sparsifier.retarget(target)
            renewed = self.sparsifier.framing()
            if isinstance(self.framing, Fixed) and isinstance(renewed, Fixed):
                self.framing.resize(renewed.capacity)  # keep its message buffers
            else:
                self.framing = renewed

    def commit(self) -> None:
        """The step that just ran is the new state (a transactional residual takes its a)."""
        self.feedback.commit()

    def rollback(self) -> None:
        """Undo the step that just failed: the sparsifier's state as before it, and (with a
        transactional residual) the residual too; the driver does not count the step."""
        self.sparsifier.load_state_dict(self._snapshot)

    def _pre_selection(self, accumulated: torch.Tensor, step: int) -> Generator[
        Collective, torch.Tensor, list[int] | None
    ]:
        """A leader's plan (which fixes every rank's count) or an all-ranks sum, if any."""
        sparsifier = self.sparsifier
        if sparsifier.planned:  # the leader must not plan for a rank at another step
            header = torch.tensor([step], device=accumulated.device)
            rows = (yield Collective("all_gather", header, "header")).tolist()
            check_steps([row[0] for row in rows])
            leader = sparsifier.leader(step)
            if self.rank == leader:
                plan = sparsifier.make_plan(accumulated, step)
            else:
                plan = sparsifier.empty_plan(accumulated.device)
            plan = yield Collective("broadcast", plan, "plan", root=leader)
            return sparsifier.adopt_plan(plan, step)
        if sparsifier.agrees:
            proposal = sparsifier.agreement(accumulated, step)
            sparsifier.adopt_agreement((yield Collective("all_reduce", proposal, "agreement")))
        return None

    def _values(self, positions: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's accumulated values at ``positions``, as sent; the residual forgets them,
        except where ``kept`` is true: there it sends 0 and keeps the whole value."""
        accumulated = self.feedback.accumulated
        values = accumulated.index_select(0, positions)
        sent = positions
        if kept is not None:
            values.masked_fill_(kept, 0)
            sent = positions[~kept]
        if self.value_dtype is None:
            self.feedback.forget(sent)
            return values
        wire = values.to(self.value_dtype)
        # What rounding took from this rank's values stays behind in its residual.
        remainder = values.sub_(wire)
        self.feedback.forget(sent, remainder if kept is None else remainder[~kept])
        return wire

    def _dense(self, step: int, fresh: Fresh, output: Output) -> Protocol_:
        clock = _Clock()
        flat = output.dense(fresh)
        nothing = torch.empty(0, dtype=torch.long, device=flat.device)
        proposal = Proposal(nothing, flat, step)
        yield from clock.local(self.framing.exchange(proposal, self.world_size))
        flat.div_(self.world_size)  # divide first, as DDP does, for identical results
        yield from clock.local(_single(Collective("all_reduce", flat, "values")))
        if bool(any_nonfinite(flat)):
            raise self._nonfinite(step, None, flat, own=False)
        numel = flat.numel()
        return StepReport(numel, numel, 0, numel, clock.bytes(self.world_size), float("nan"),
                          0.0, clock.lap(), local_proposed=numel,
                          message_bytes=clock.message_bytes())  # fmt: skip

    def _nonfinite(
        self, step: int, positions: torch.Tensor | None, summed: torch.Tensor, own: bool
    ) -> NonFiniteGradientError:
        layout = self.sparsifier.layout
        if positions is None:  # dense: the sum is the whole vector
            positions = torch.arange(summed.numel(), device=summed.device)
        bad = positions[~torch.isfinite(summed)][:100].tolist()
        names = sorted({layout.locate(p) for p in bad}) or ["positions not sent this step"]
        whose = (
            "this rank sent non-finite values"
            if own
            else "this rank's own values were finite (another rank sent them)"
        )
        return NonFiniteGradientError(
            f"step {step}: NaN or Inf gradient in {', '.join(names)} (in the sum over ranks); "
            f"{whose}. Lower the learning rate, clip gradients, or unscale AMP gradients before "
            "averaging"
        )


def _inside(positions: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Which of ``positions`` lie in one of the ranges [start, end)."""
    inside = torch.zeros_like(positions, dtype=torch.bool)
    for start, end in ranges:
        inside |= (positions >= start) & (positions < end)
    return inside


def _single(request: Collective) -> Generator[Collective, torch.Tensor, torch.Tensor]:
    return (yield request)


class _Clock:
    """Local seconds of a step's protocol (the time between resuming it and its next request)
    and the wire bytes of its requests."""

    def __init__(self) -> None:
        self._mark = time.perf_counter()
        self._local = 0.0
        self._requests: list[Collective] = []

    def local(self, protocol: Generator[Collective, torch.Tensor, Any]) -> Generator[
        Collective, torch.Tensor, Any
    ]:
        """Run ``protocol`` as a sub-step, counting only the time spent inside it."""
        try:
            request = next(protocol)
            while True:
                self._local += time.perf_counter() - self._mark
                self._requests.append(request)
                result = yield request
                self._mark = time.perf_counter()
                request = protocol.send(result)
        except StopIteration as done:
            return done.value

    def lap(self) -> float:
        """Local seconds since the previous lap."""
        now = time.perf_counter()
        seconds, self._local, self._mark = self._local + now - self._mark, 0.0, now
        return seconds

    def bytes(self, world_size: int) -> int:
        return sum(request.wire_bytes(world_size) for request in self._requests)

    def message_bytes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for request in self._requests:
            size = request.tensor.numel() * request.tensor.element_size()
            sizes[request.what] = sizes.get(request.what, 0) + size
        return sizes


def run_blocking(protocol: Protocol_, collectives: Collectives) -> StepReport:
    """Drive a step to its end, running each request on ``collectives`` as it comes."""
    try:
        request = next(protocol)
        while True:
            request = protocol.send(collectives.run(request))
    except StopIteration as done:
        return done.value
