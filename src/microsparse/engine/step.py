"""One sparse averaging step over one slab, written once for every driver.

A *slab* is a flat vector of parameters (the whole model for ``GradientReducer``, one group
of DDP's buckets for the hook) with its error-feedback residual. :meth:`SparseStep.run` is the
whole protocol of one step, top to bottom:

1. **guard**: every rank shares, in one small all-gather, whether its fresh gradient holds a
   NaN or Inf (one fused read pass) and its step counter (:class:`Guard`);
2. **compensate**: add the fresh gradients into the residual in place, a = e + g;
3. **pre-selection round**, if the sparsifier asks for one: a leader's plan, or an all-ranks
   sum such as MiCRO's threshold histogram;
4. **select**: the sparsifier proposes this rank's positions;
5. **index exchange**: the sparsifier's framing (``microsparse.comm.framing``) makes every
   rank learn all positions;
6. **values**: gather a at those positions (rounded to the wire dtype if asked, the rounding
   kept in the residual), forget them locally (the new residual), all-reduce; as 8-bit
   integers (``value_dtype=torch.int8``), on a scale every rank learnt in the index message
   (:func:`quantise`);
7. **finish**: divide by n, write the sparse average, tell the sparsifier the global count.

Where the gradient is one flat tensor (a DDP bucket, an FSDP shard) and the sparsifier can
select from e + g before it is written (MiCRO's quotas on the compact wire, plain error
feedback, no density warm-up), the step is two rounds instead of three:
this rank selects from |e + g|, its guard message rides in the compact index message, and
only then, the verdict known, a = e + g is written (:meth:`SparseStep._guard_in_message`);
the same selection, the same bytes.

A step whose guard finds a NaN or Inf on any rank, or ranks at different steps, leaves every
residual exactly as it was. Where the sparsifier fixes every size of the step in advance
(MiCRO's quotas, dense), nothing in it is read back to the host: the guard's verdict stays
on the device, the fused kernels of ``compensate`` and the masked writes of ``forget`` obey
it, and the average is written as NaN, so that a ``GradScaler`` skips the step and an
unscaled optimiser meets the NaN as it would with plain DDP. The host reads the verdict only
at the first step after a start or a restore (where disagreeing ranks are found), with
``nonfinite="raise"`` (to raise :class:`~microsparse.NonFiniteGradientError` on every rank
before anything changed), and for sparsifiers whose sizes depend on the data, which read
counts on the host anyway: there a failed step is skipped, or raised, before it begins.

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
from typing import Any, Literal, Protocol

import torch

from microsparse.comm.collectives import Collective, Collectives, check_steps
from microsparse.comm.framing import Dense, Exchanged, Fixed, FixedUnion, Proposal, Shared
from microsparse.engine.output import as_dtype
from microsparse.engine.timing import elapsed, mark
from microsparse.errors import NonFiniteGradientError
from microsparse.feedback import ErrorFeedback, Fresh, flag_nonfinite
from microsparse.sparsifiers import Sparsifier
from microsparse.stats import Pending

Protocol_ = Generator[Collective, torch.Tensor, "StepReport"]
NonFinite = Literal["skip", "raise"]
NONFINITE = ("skip", "raise")


class Output(Protocol):
    """Where a step writes the averaged gradient (``microsparse.engine.output``)."""

    def write(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Make the output the sparse vector with ``values`` at ``positions``, zero elsewhere."""

    def dense(self, fresh: Fresh) -> torch.Tensor:
        """The fresh gradient as one flat tensor that *is* the output (averaged in place)."""

    def poison(self) -> None:
        """Fill with NaN: a skipped step (a ``GradScaler`` then skips it too)."""


@dataclass
class StepReport:
    """What one step of one slab selected, sent and cost (local times only).

    Numbers the step left on the device (a threshold, a count that depends on the data,
    whether it was skipped, times taken with CUDA events) are :class:`~microsparse.stats.Pending`.
    """

    selected: int | Pending
    local_selected: int | Pending
    message_slots: int
    proposed: int | Pending
    bytes_sent: int
    threshold: float | Pending
    select_seconds: float | Pending
    """Local work up to the end of selection (guard, compensation, plan or agreement, selection)."""
    finish_seconds: float | Pending
    """Local work after selection (framing, decoding, gathering, writing), no waiting; on a
    GPU, the device's time from the end of selection to the end of the step."""
    extra: dict[str, Any] = field(default_factory=dict)
    partition: tuple[int, int] | None = None
    local_proposed: int | Pending = 0
    """This rank's proposals before a fixed message's capacity cut them."""
    message_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of this rank's message in each kind of request (``Collective.what``)."""
    skipped: bool | Pending = False
    """A NaN or Inf on some rank (or ranks at different steps): nothing changed."""
    payload_bytes: int = 0
    """Bytes of the step's messages, each rank's counted once (:meth:`Collective.payload_bytes`)."""


_TINY = torch.finfo(torch.float32).tiny
"""The least scale of an int8 step (its values all 0, or nearly): a normal number, never 0."""


def quantise(
    values: torch.Tensor, scale: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` as 8-bit integers on ``scale`` (round(v / scale), clipped to ±``levels``),
    and what rounding and clipping took, to stay in the sender's residual.

    The engine's int8 step (``value_dtype=torch.int8``): every rank learnt every rank's
    largest |value| at its own positions in the index message; the largest of them over
    ``levels`` = 127 // n is the scale, so that the sum of n ranks' integers fits 8 bits (the
    all-reduce sums int8). A rank's value at another rank's position may lie beyond: clipped.

    Example:
        >>> wire, left = quantise(torch.tensor([3.0, -1.2, 20.0]), torch.tensor([0.5]), 31)
        >>> wire.tolist(), [round(x, 3) for x in left.tolist()]      # 20 is 40 steps: clipped
        ([6, -2, 31], [0.0, -0.2, 4.5])
    """
    integers = torch.div(values, scale).round_().clamp_(-levels, levels)
    return integers.to(torch.int8), torch.addcmul(values, integers, scale, value=-1)


class Guard:
    """The first round of every step: each rank's non-finite flag and step, all-gathered.

    The flag comes from one fused read pass over the fresh gradients
    (:func:`~microsparse.feedback.flag_nonfinite`), written straight into the message; the
    verdict, True if any rank's flag is set or any rank's step differs, stays on the device
    (:meth:`skip`) unless read (:meth:`check`). Every kernel counts where a step is bound by
    the host: the message [flag, step] and the row it is compared with, [0, step], share one
    buffer, written [0, step, 0, step] by one multiplication of a constant [0, 1, 0, 1].

    Example:
        >>> guard = Guard(torch.device("cpu"))
        >>> request = guard.request([torch.tensor([1.0, float("inf")])], step=3)
        >>> rows = request.tensor.unsqueeze(0)           # a group of one
        >>> guard.skip(rows)
        tensor([True])
    """

    BYTES = 8
    """Each rank's message: the flag and the step (modulo 2**24, exact in float32)."""
    PERIOD = 2**24

    def __init__(self, device: torch.device) -> None:
        self._pattern = torch.tensor([0.0, 1.0, 0.0, 1.0], device=device)
        self._buffer = torch.zeros(4, dtype=torch.float32, device=device)
        self._message, self._expected = self._buffer[:2], self._buffer[2:]
        self._flag = self._buffer[:1]

    def request(self, fresh: Fresh, step: int) -> Collective:
        """Flag this rank's gradient and return the all-gather of [flag, step]."""
        return Collective("all_gather", self.message(fresh, step), "guard")

    def message(self, fresh: Fresh, step: int) -> torch.Tensor:
        """This rank's [flag, step] (float32), to be all-gathered on its own or inside an
        index message."""
        # The step is a kernel argument, not a copy from the host; exact below 2**24.
        torch.mul(self._pattern, step % self.PERIOD, out=self._buffer)
        flag_nonfinite(fresh, self._flag, cleared=True)
        return self._message

    def skip(self, rows: torch.Tensor) -> torch.Tensor:
        """True (one-element bool, on the device) if any rank flagged or is at another step
        than this rank's last :meth:`request`."""
        return rows.ne(self._expected).any().view(1)

    @staticmethod
    def check(rows: torch.Tensor, what: str = "synchronize()") -> list[int]:
        """Read the rows on the host: raise ``ConfigMismatchError`` if the ranks' steps
        differ; return the ranks whose gradient holds a NaN or Inf."""
        table = rows.tolist()
        check_steps([int(row[1]) for row in table], what)
        return [rank for rank, row in enumerate(table) if row[0]]


class SparseStep:
    """The protocol of one step over one slab; see the module docstring.

    Args:
        sparsifier: a registry sparsifier, already bound to the slab's layout.
        feedback: the slab's residual.
        value_dtype: send the selected values as this dtype (``torch.float16``,
            ``torch.bfloat16``, or ``torch.int8`` on a framing that carries a scale: see
            :func:`quantise`); each rank's rounding error stays in its residual. None: the
            framing's choice (``Compact``: int8 up to 16 ranks, bfloat16 beyond), else the
            gradient's dtype.
        schedule: k of each step (a density warm-up), if it is not the sparsifier's k.
        nonfinite: ``"skip"``: a step with a NaN or Inf on any rank changes nothing and
            writes NaN; ``"raise"``: every rank raises ``NonFiniteGradientError`` instead
            (the host reads the guard at every step).
    """

    def __init__(
        self,
        sparsifier: Sparsifier,
        feedback: ErrorFeedback,
        value_dtype: torch.dtype | None = None,
        schedule: Callable[[int], int] | None = None,
        nonfinite: NonFinite = "skip",
    ) -> None:
        self.sparsifier = sparsifier
        self.framing = sparsifier.framing()
        self.schedule = schedule
        if sparsifier.planned and sparsifier.agrees:
            raise TypeError(
                f"sparsifier {sparsifier.name!r} is planned and asks for an agreement: a step "
                "has either a leader's plan or an all-ranks sum (see Sparsifier)"
            )
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
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be 'skip' or 'raise'; got {nonfinite!r}")
        self.feedback = feedback
        # A framing may ask for narrower values (Compact: int8 or bfloat16) where none is named.
        self.value_dtype = value_dtype if value_dtype is not None else self.framing.value_dtype
        self.nonfinite = nonfinite
        self.rank = sparsifier.rank
        self.world_size = sparsifier.world_size
        self.levels = self._int8_levels()
        """The largest |integer| a rank sends where the values travel as int8, else 0."""
        self.guard = Guard(feedback.residual.device)
        self.check_next = True
        """Read the next step's guard on the host (the first step after a start or restore)."""

    def _int8_levels(self) -> int:
        if self.value_dtype != torch.int8 or isinstance(self.framing, Dense):
            return 0
        self.framing.check_value_dtype(self.value_dtype, self.sparsifier.name)
        if self.world_size > 127:
            raise ValueError(
                "value_dtype=torch.int8 sums every rank's 8-bit values, which leaves each of "
                f"{self.world_size} ranks less than one level (127 // n): use "
                "value_dtype=torch.bfloat16 beyond 127 ranks"
            )
        return 127 // self.world_size

    def run(
        self,
        step: int,
        fresh: Fresh,
        output: Output,
        exclude: Sequence[tuple[int, int]] = (),
        scale: torch.Tensor | None = None,
    ) -> Protocol_:
        """The requests of step ``step``; returns its :class:`StepReport`.

        ``fresh`` is the slab's gradient (flat, or per parameter with ``None`` for none); it
        may be overwritten. ``exclude`` lists ranges [start, end) of the slab that this rank
        did not use (DDP drops the average of a parameter that no rank used). This rank
        proposes nothing there; where a leader's plan (CLT-k, DEFT), the oracle's sum or a
        fixed union (top-k's fixed wire) fixes the positions or their number, it sends 0 at
        those inside the ranges and keeps its residual there.
        ``scale``: a one-element tensor the gradients are scaled by (a ``GradScaler``'s): the
        residual keeps unscaled values, and the average is written scaled.
        """
        self._snapshot = self.sparsifier.state_dict()
        clock = _Clock(self.feedback.residual.device)
        if self._selects_first(fresh):
            return (yield from self._guard_in_message(step, fresh, output, exclude, scale,
                                                      clock))  # fmt: skip
        rows = yield from clock.local(_single(self.guard.request(fresh, step)))
        if isinstance(self.framing, Dense):
            return (yield from self._dense(step, fresh, output, rows, clock))
        if self.schedule is not None:
            self._follow_schedule(step)
        sparsifier = self.sparsifier
        counts = sparsifier.counts(step)
        skip = skipped = None
        # Only where every size is known before the data (quotas in a fixed message) does
        # the step run without reading anything back; elsewhere the guard is read first.
        sync_free = counts is not None and not exclude and self.framing.decodes_known_counts
        if self._read_guard(sync_free):
            bad = self._checked(rows, step, fresh)
            if bad:  # every rank knows: nothing of this step is done anywhere
                output.poison()
                return self._skipped(clock)
        else:
            skipped = self.guard.skip(rows)
            skip = skipped.to(torch.float32)  # what torch's fused kernels skip on
        self.feedback.compensate(fresh, step, skip, scale)
        accumulated = self.feedback.accumulated
        planned = yield from clock.local(self._pre_selection(accumulated, step))
        counts = planned if planned is not None else counts
        # The fresh gradient is consumed by now: the sparsifier may use it as scratch.
        flat = isinstance(fresh, torch.Tensor) and fresh.is_contiguous()
        scratch = fresh.view(-1) if flat else None  # type: ignore[union-attr]
        local = sparsifier.select(accumulated, step, scratch)
        # A leader's plan, the oracle's sum or a fixed union's k a rank fixes what every rank
        # sends: a rank cannot leave out the parameters it did not use there, so it sends 0
        # at them instead (below).
        fixed = planned is not None or isinstance(self.framing, (Shared, FixedUnion))
        if exclude and not fixed:
            local = local[~_inside(local, exclude)]
            counts = None
        threshold, extra = _pending(sparsifier.threshold), sparsifier.report()
        select_seconds = clock.lap()
        largest = self._largest(local, accumulated, None, None, scale)
        proposal = Proposal(local, accumulated, step, counts, value_scale=largest)
        exchanged = yield from clock.local(self.framing.exchange(proposal, self.world_size))
        # If no rank used a parameter, DDP drops its average: what was sent there would be lost.
        unused = _inside(exchanged.positions, exclude) if exclude and fixed else None
        return (yield from self._finish(step, exchanged, output, unused, skipped, scale, clock,
                                        (threshold, extra, select_seconds)))  # fmt: skip

    def _selects_first(self, fresh: Fresh) -> bool:
        """Whether this step selects from e + g before writing the residual, its guard riding
        in the index message (one round less): a framing with room for it, a sparsifier that
        can, no round before selection, plain error feedback, one flat gradient."""
        sparsifier, feedback = self.sparsifier, self.feedback
        return (self.framing.carries_guard and sparsifier.selects_from_sum
                and not (sparsifier.planned or sparsifier.agrees or self.schedule is not None)
                and not (feedback.momentum or feedback.adam)
                and isinstance(fresh, torch.Tensor) and fresh.is_contiguous()
                and fresh.dtype == feedback.residual.dtype)  # fmt: skip

    def _guard_in_message(
        self,
        step: int,
        fresh: torch.Tensor,
        output: Output,
        exclude: Sequence[tuple[int, int]],
        scale: torch.Tensor | None,
        clock: _Clock,
    ) -> Protocol_:
        """The step in two rounds: select from e + g (e + g / scale under a ``GradScaler``),
        exchange the positions with every rank's guard, then (the verdict known) write a, send
        the values, keep the rest.

        Nothing is written before the index round, so a step the guard fails there, read on
        the host or not, changes nothing: the same outcomes as a guard round of its own."""
        sparsifier, residual = self.sparsifier, self.feedback.residual
        guard = self.guard.message(fresh, step)
        flat = fresh.view(-1)
        local = sparsifier.select(residual, step, addend=flat, divisor=scale)  # type: ignore[call-arg]
        counts = sparsifier.counts(step)
        if exclude:
            local = local[~_inside(local, exclude)]
            counts = None
        largest = self._largest(local, residual, flat, scale, scale)
        timing = (_pending(sparsifier.threshold), sparsifier.report(), clock.lap())
        proposal = Proposal(local, residual, step, counts, guard, largest)
        exchanged = yield from clock.local(self.framing.exchange(proposal, self.world_size))
        rows = exchanged.guard_rows
        assert rows is not None
        skipped = skip = None
        if self._read_guard(counts is not None):
            if self._checked(rows, step, fresh):  # every rank knows: nothing was written
                output.poison()
                return self._skipped(clock)
        else:
            skipped = self.guard.skip(rows)
            skip = skipped.to(torch.float32)
        self.feedback.compensate(flat, step, skip, scale)
        return (yield from self._finish(step, exchanged, output, None, skipped, scale, clock,
                                        timing))  # fmt: skip

    def _finish(
        self,
        step: int,
        exchanged: Exchanged,
        output: Output,
        unused: torch.Tensor | None,
        skipped: torch.Tensor | None,
        scale: torch.Tensor | None,
        clock: _Clock,
        timing: tuple[Any, dict[str, Any], float | Pending],
    ) -> Protocol_:
        """Send the values at the exchanged positions, keep the rest, write the average."""
        sparsifier, positions = self.sparsifier, exchanged.positions
        threshold, extra, select_seconds = timing
        shared = None
        if self.levels:  # every rank's largest |value|, the largest of them mapped to ±levels
            assert exchanged.scale_rows is not None
            shared = exchanged.scale_rows.amax().div_(self.levels).clamp_(min=_TINY).view(1)
        values = self._values(positions, unused, skipped, scale, shared)
        averaged = yield from self._average(values, self.feedback.accumulated.dtype, skipped,
                                            clock, shared)  # fmt: skip
        repeats, selected = exchanged.repeats, positions.numel()
        if repeats is None:
            sparsifier.update(selected)
        else:  # a position several ranks picked: its sum is written once
            averaged.masked_fill_(repeats, 0)
            selected = Pending(lambda: positions.numel() - int(repeats.sum()))
        output.write(positions, averaged)
        return StepReport(
            selected=selected,
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
            skipped=False if skipped is None else Pending(skipped.item),
            payload_bytes=clock.payload(self.world_size),
        )

    def _average(
        self,
        values: torch.Tensor,
        dtype: torch.dtype,
        skipped: torch.Tensor | None,
        clock: _Clock,
        shared: torch.Tensor | None = None,
    ) -> Generator[Collective, torch.Tensor, torch.Tensor]:
        """The values every rank sent, summed over ranks and divided by n, in ``dtype``
        (integers first multiplied by their ``shared`` scale)."""
        summed = yield from clock.local(_single(Collective("all_reduce", values, "values")))
        if shared is not None:  # integers times their scale, in dtype: one kernel
            averaged = torch.mul(summed, as_dtype(shared, dtype))
        else:
            averaged = as_dtype(summed, dtype)
        averaged.div_(self.world_size)
        if skipped is not None:  # a skipped step averages to NaN, which a GradScaler skips
            averaged.masked_fill_(skipped, math.nan)
        return averaged

    def _read_guard(self, sync_free: bool) -> bool:
        """Whether this step reads its guard on the host."""
        return self.check_next or self.nonfinite == "raise" or not sync_free

    def _checked(self, rows: torch.Tensor, step: int, fresh: Fresh) -> bool:
        """The guard read on the host: raises on ranks at other steps, and on a NaN or Inf
        with ``nonfinite="raise"``; else whether the step is skipped."""
        bad = Guard.check(rows)  # ranks at other steps raise here, and are checked again
        self.check_next = False
        if bad and self.nonfinite == "raise":
            raise self._nonfinite(step, bad, fresh)
        return bool(bad)

    def _skipped(self, clock: _Clock) -> StepReport:
        return StepReport(0, 0, 0, 0, clock.bytes(self.world_size), math.nan, clock.lap(), 0.0,
                          message_bytes=clock.message_bytes(), skipped=True,
                          payload_bytes=clock.payload(self.world_size))  # fmt: skip

    def _follow_schedule(self, step: int) -> None:
        """Move k to the schedule's for ``step`` (a function of the step alone, so that a
        resumed or rolled-back run finds the same k); the index message follows."""
        target = self.schedule(step)  # type: ignore[misc]
        if target != self.sparsifier.target:
            self.sparsifier.retarget(target)
            renewed = self.sparsifier.framing()
            if isinstance(self.framing, Fixed) and isinstance(renewed, Fixed):
                self.framing.resize(renewed.capacity)  # keep its message buffers
            else:
                self.framing = renewed

    def rollback(self) -> None:
        """Undo the step that just failed: the sparsifier's state as before it; the driver
        does not count the step. (A step fails before it changes any residual.)"""
        self.sparsifier.load_state_dict(self._snapshot)

    def _pre_selection(self, accumulated: torch.Tensor, step: int) -> Generator[
        Collective, torch.Tensor, list[int] | None
    ]:
        """A leader's plan (which fixes every rank's count) or an all-ranks sum, if any."""
        sparsifier = self.sparsifier
        if sparsifier.planned:  # the guard has checked that every rank is at this step
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

    def _largest(
        self,
        local: torch.Tensor,
        accumulated: torch.Tensor,
        addend: torch.Tensor | None,
        divisor: torch.Tensor | None,
        scale: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Where the values travel as int8: the largest |a| this rank sends at its own
        positions (a = accumulated + addend / divisor, as sent: times ``scale``), float32."""
        if not self.levels:
            return None
        if local.numel() == 0:
            return torch.zeros(1, dtype=torch.float32, device=accumulated.device)
        largest = self.sparsifier.largest_sent(local)  # one kernel where selection found it
        if largest is None:
            values = accumulated.index_select(0, local)
            if addend is not None:
                more = addend.index_select(0, local)
                values = values.add_(more) if divisor is None else values.addcdiv_(more, divisor)
            largest = values.abs_().amax().view(1)
        largest = as_dtype(largest, torch.float32)
        return largest if scale is None else largest.mul_(scale)

    def _values(
        self,
        positions: torch.Tensor,
        kept: torch.Tensor | None,
        skip: torch.Tensor | None,
        scale: torch.Tensor | None,
        shared: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's accumulated values at ``positions``, as sent; the residual forgets them,
        except where ``kept`` is true (there it sends 0 and keeps the whole value) or when
        the step is skipped (``skip``, a bool tensor, holds True: the residual keeps all)."""
        accumulated = self.feedback.accumulated
        values = accumulated.index_select(0, positions)  # also what a skipped step keeps
        sent_values = values if kept is None else values.masked_fill(kept, 0)
        if scale is not None:  # the residual is unscaled; the average is written scaled
            sent_values = sent_values * as_dtype(scale, values.dtype)
        sent, wire, left = positions, sent_values, None
        if self.value_dtype is not None:
            # What rounding took from this rank's values stays behind in its residual.
            if shared is not None:
                wire, left = quantise(sent_values, shared, self.levels)
            else:
                wire = sent_values.to(self.value_dtype)
                left = sent_values - wire
            if scale is not None:
                left.div_(as_dtype(scale, left.dtype))
        if kept is not None:
            keep = ~kept
            sent, values = positions[keep], values[keep]
            left = None if left is None else left[keep]
        if skip is not None:  # a skipped step forgets nothing
            left = torch.where(skip, values, 0.0 if left is None else left)
        self.feedback.forget(sent, left)
        self.feedback.mask_velocity(sent, skip)
        return wire

    def _dense(
        self, step: int, fresh: Fresh, output: Output, rows: torch.Tensor, clock: _Clock
    ) -> Protocol_:
        flat = output.dense(fresh)
        bad = self._checked(rows, step, fresh) if self._read_guard(True) else []
        flat.div_(self.world_size)  # divide first, as DDP does, for identical results
        yield from clock.local(_single(Collective("all_reduce", flat, "values")))
        numel = flat.numel()
        return StepReport(numel, numel, 0, numel, clock.bytes(self.world_size), math.nan,
                          0.0, clock.lap(), local_proposed=numel,
                          message_bytes=clock.message_bytes(), skipped=bool(bad),
                          payload_bytes=clock.payload(self.world_size))  # fmt: skip

    def _nonfinite(self, step: int, bad: list[int], fresh: Fresh) -> NonFiniteGradientError:
        if self.rank not in bad:
            return NonFiniteGradientError(
                f"step {step}: NaN or Inf gradient on rank {', '.join(map(str, bad))}; this "
                "rank's own gradient was finite. Lower the learning rate, clip gradients, or "
                "unscale AMP gradients before averaging"
            )
        layout = self.sparsifier.layout
        gradients = [fresh] if isinstance(fresh, torch.Tensor) else list(fresh)
        names: list[str] = []
        if len(gradients) == 1 and gradients[0] is not None and len(layout.names) > 1:
            flat = gradients[0].reshape(-1)
            bad_at = torch.nonzero(~torch.isfinite(flat)).squeeze(1)[:100].tolist()
            names = sorted({layout.locate(p) for p in bad_at})
        else:
            names = [name for name, g in zip(layout.names, gradients)
                     if g is not None and not bool(torch.isfinite(g).all())]  # fmt: skip
        return NonFiniteGradientError(
            f"step {step}: NaN or Inf gradient in {', '.join(names)}; this rank's gradient "
            "holds them. Lower the learning rate, clip gradients, or unscale AMP gradients "
            "before averaging"
        )


def scaler_scale(scaler: Any) -> torch.Tensor | None:
    """A ``GradScaler``'s scale as the device tensor it keeps (None if it scales nothing):
    ``get_scale()`` would read it back to the host."""
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)
    if scale is None:
        raise RuntimeError(
            "grad_scaler has no scale yet: call scaler.scale(loss).backward() before the "
            "gradients are averaged"
        )
    return scale


def _pending(value: Any) -> Any:
    """A device tensor as a :class:`Pending` number, anything else as it is."""
    return Pending.of(value) if isinstance(value, torch.Tensor) else value


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
    and the wire bytes of its requests. On a GPU the seconds are the device's, between CUDA
    events, read only when asked."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._mark = mark(device)
        self._local = 0.0
        self._requests: list[Collective] = []

    def local(self, protocol: Generator[Collective, torch.Tensor, Any]) -> Generator[
        Collective, torch.Tensor, Any
    ]:
        """Run ``protocol`` as a sub-step, counting (on a CPU) only the time spent inside it."""
        try:
            request = next(protocol)
            while True:
                if not self._cuda:
                    self._local += time.perf_counter() - self._mark
                self._requests.append(request)
                result = yield request
                if not self._cuda:
                    self._mark = time.perf_counter()
                request = protocol.send(result)
        except StopIteration as done:
            return done.value

    def lap(self) -> float | Pending:
        """Local seconds since the previous lap."""
        now = mark(self._device)
        if self._cuda:
            begin, self._mark = self._mark, now
            return elapsed(begin, now)
        seconds, self._local, self._mark = self._local + now - self._mark, 0.0, now
        return seconds

    def bytes(self, world_size: int) -> int:
        return sum(request.wire_bytes(world_size) for request in self._requests)

    def payload(self, world_size: int) -> int:
        return sum(request.payload_bytes(world_size) for request in self._requests)

    def message_bytes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for request in self._requests:
            sizes[request.what] = sizes.get(request.what, 0) + request.nbytes
        return sizes


def run_blocking(protocol: Protocol_, collectives: Collectives) -> StepReport:
    """Drive a step to its end, running each request on ``collectives`` as it comes."""
    try:
        request = next(protocol)
        while True:
            request = protocol.send(collectives.run(request))
    except StopIteration as done:
        return done.value
