"""MiCRO: threshold selection inside an exclusively owned, rotating partition."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from microsparse.comm.framing import Compact, Fixed, Framing, Padded
from microsparse.layout import Layout
from microsparse.sparsifiers.base import Candidates, Sparsifier
from microsparse.sparsifiers.largest import LargestFinder
from microsparse.sparsifiers.partition import PARTITIONINGS, Segment, owned_partition
from microsparse.sparsifiers.registry import register_sparsifier
from microsparse.sparsifiers.threshold import (
    THRESHOLD_RULES,
    QuantileThreshold,
    ThresholdController,
    ThresholdRule,
)
from microsparse.stats import Pending

Partitioning = Literal["interleaved", "contiguous"]
IndexMessage = Literal["fixed", "padded"]
Selection = Literal["quota", "threshold"]
Wire = Literal["plain", "compact", "compact_positions"]
SELECTIONS = ("quota", "threshold")
INDEX_MESSAGES = ("fixed", "padded")
WIRES = ("plain", "compact", "compact_positions")
INT8_RANKS = 16
"""Up to this many ranks the compact wire's values travel as 8-bit integers unless
``value_dtype`` names another dtype; beyond, as bfloat16. The 8-bit sum of n ranks leaves
each 127 // n levels (7 at 16); measured at 4 and 16 ranks, the more entries a budget buys
with one byte a value instead of two trained closer to dense on every task."""


def compact_values(world_size: int | None) -> torch.dtype:
    """The compact wire's value dtype where ``value_dtype`` names none, on ``world_size``
    ranks (None: not known yet, priced as a world of at most :data:`INT8_RANKS`).

    Example:
        >>> compact_values(4), compact_values(64)
        (torch.int8, torch.bfloat16)
    """
    return torch.int8 if world_size is None or world_size <= INT8_RANKS else torch.bfloat16


@register_sparsifier
class Micro(Sparsifier):
    """MiCRO (Yoon & Oh, HiPC 2023); the reference code's behaviour is one set of options.

    1. The flat vector is cut into n near-equal partitions (``partitioning``).
    2. At step t, rank r owns partition (t + r) mod n: no two ranks select the same
       position, so the union of all selections has exactly K = Σ k_r entries (no build-up).
    3. Rank r selects inside its partition (``selection``): no sort over it.

    Options:
        selection: ``"quota"`` (the default unless a ``threshold_rule`` is given): k is
            shared among the partitions, ⌊(j+1)·k/n⌋ − ⌊j·k/n⌋ for the partition whose share
            index this step is j = (p + t) mod n, so the shares sum to exactly k at every
            step and rotate, and the owner of each partition sends exactly its share of the
            largest |a| there. A rank finds them exactly for about one compare over its d/n
            entries (:mod:`~microsparse.sparsifiers.largest`): no collective, no threshold to
            carry, and every rank's index message (⌈k/n⌉ slots) is full or one short.
            ``"threshold"`` (the default when a ``threshold_rule`` is given): the paper's
            rule. Every rank sends every position of its partition with |a| >= λ, one λ
            shared by all ranks from ``threshold_rule``, so the counts k_r differ by rank. If
            nothing passes, a rank sends one fallback position (the (t mod size)-th entry of
            its partition), so that its message is never empty.
        threshold_rule: only with ``selection="threshold"``. ``"quantile"`` (default): λ is
            estimated from the current step's data through one all-reduce of a small
            histogram, so the actual density is on target from the first steps and after
            gradient-scale changes. ``"symmetric"`` and ``"as_coded"``: the paper's
            ±0.5 %-per-step correction from the previous step's count (``as_coded`` keeps
            the reference's dead branch).
        partitioning: ``"interleaved"`` (default): small blocks dealt round-robin, so every
            partition holds a slice of every layer and the per-rank counts are balanced.
            ``"contiguous"``: the reference's n contiguous ranges.
        index_message: ``"fixed"`` (default): each rank sends one all-gather message of int32
            slots that carries its own count and the step's check, so no separate count
            round is needed: ⌈k/n⌉ slots with quotas, ``ceil(capacity_factor · k / n) + 8``
            with a shared threshold. If more positions pass the threshold, the largest are
            sent and the rest stay in the residual (``StepStats.proposed − selected`` counts
            them). ``"padded"``: the reference's count all-gather, then indices padded to the
            largest count.
        capacity_factor: slack of the fixed message over an even share k / n (threshold
            selection).
        wire: ``"compact"`` (the default where the options allow it: quotas in the fixed
            message): the positions as offsets into the owned partition in Elias–Fano
            form, about 2 + log2(1 / density) bits each
            (:class:`~microsparse.comm.framing.Compact`), and the values, unless
            ``value_dtype`` names a dtype, as 8-bit integers on a scale every rank learns
            in the index message up to :data:`INT8_RANKS` ranks, as bfloat16 beyond: about
            2.3 or 3.3 bytes an entry instead of 8, the rounding kept in the residual. At
            equal bytes it carries three to four times the entries, which trained better on
            every task measured (docs/results, "accuracy per byte").
            ``"compact_positions"``: the same positions, the values as ``value_dtype`` says.
            ``"plain"`` (the default with a shared threshold or the padded message): int32
            positions as ``index_message`` says, values as the reducer's ``value_dtype``
            (float32 unless it names one).

    ``selection="threshold", threshold_rule="as_coded", partitioning="contiguous",
    index_message="padded"`` reproduces the reference code.

    Example:
        >>> import torch
        >>> from microsparse import GradientReducer
        >>> model = torch.nn.Linear(1000, 100)
        >>> reference = GradientReducer(model.parameters(), "micro", 0.001,
        ...     selection="threshold", threshold_rule="as_coded", partitioning="contiguous",
        ...     index_message="padded")
    """

    name = "micro"

    def __init__(
        self,
        density: float,
        selection: Selection | None = None,
        threshold_rule: ThresholdRule | None = None,
        partitioning: Partitioning = "interleaved",
        index_message: IndexMessage = "fixed",
        capacity_factor: float = 1.25,
        wire: Wire | None = None,
    ) -> None:
        super().__init__(density)
        if selection is None:  # naming a threshold rule asks for a shared threshold
            selection = "quota" if threshold_rule is None else "threshold"
        if threshold_rule is None:
            threshold_rule = "quantile"
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}; got {selection!r}")
        if selection == "quota" and threshold_rule != "quantile":
            raise ValueError(
                f"threshold_rule={threshold_rule!r} needs selection='threshold': with "
                "selection='quota' every rank finds its own largest entries"
            )
        if threshold_rule not in THRESHOLD_RULES:
            raise ValueError(
                f"threshold_rule must be one of {', '.join(THRESHOLD_RULES)}; "
                f"got {threshold_rule!r}"
            )
        if partitioning not in PARTITIONINGS:
            raise ValueError(
                f"partitioning must be one of {', '.join(PARTITIONINGS)}; got {partitioning!r}"
            )
        if index_message not in INDEX_MESSAGES:
            raise ValueError(f"index_message must be fixed or padded; got {index_message!r}")
        if (
            isinstance(capacity_factor, bool)
            or not isinstance(capacity_factor, (int, float))
            or not 1 <= capacity_factor < math.inf
        ):
            raise ValueError(f"capacity_factor must be a number >= 1, got {capacity_factor!r}")
        if wire is None:  # the compact wire wherever the options can carry it
            wire = "compact" if (selection, index_message) == ("quota", "fixed") else "plain"
        _check_wire(wire, selection, index_message)
        self.wire: Wire = wire
        self.selection = selection
        self.threshold_rule = threshold_rule
        self.partitioning = partitioning
        self.index_message = index_message
        self.capacity_factor = float(capacity_factor)

    def bind(self, layout: Layout, rank: int, world_size: int, target: int | None = None) -> None:
        super().bind(layout, rank, world_size, target)
        self._partitions = PARTITIONINGS[self.partitioning](layout.numel, world_size)
        sizes = [self._partitions.size(p) for p in range(world_size)]
        self._largest = max(sizes)
        if self.selection == "quota":
            self._rule: QuantileThreshold | ThresholdController | None = None
            self._finder = LargestFinder()
        else:
            self._rule = (
                QuantileThreshold(self.target)
                if self.threshold_rule == "quantile"
                else ThresholdController(self.target, self.threshold_rule)
            )
        self.retarget(self.target)
        self._candidates = Candidates()
        self._scratch: torch.Tensor | None = None
        self._magnitudes_of_step: int | None = None  # the step whose |a| the scratch holds
        # select()'s last (positions, offsets into the partition): what a compact message sends
        self._chosen: tuple[torch.Tensor, torch.Tensor] | None = None
        self._threshold = math.nan

    def retarget(self, target: int) -> None:
        super().retarget(target)
        self.capacity = self._capacity(target)
        if self._rule is not None:  # λ carries over; the rule now aims at the new k
            self._rule.target = target

    def _capacity(self, target: int) -> int:
        n = self.world_size
        if self.selection == "quota":  # room for the largest share, ⌈k/n⌉
            return min(math.ceil(target / n), self._largest)
        return math.ceil(self.capacity_factor * target / n) + 8

    def _wire_format(
        self, world_size: int | None = None
    ) -> tuple[type[Framing], torch.dtype | None]:
        """The framing class ``wire`` and ``index_message`` choose, and the values' dtype
        where the user names none, on ``world_size`` ranks."""
        if self.wire != "plain":
            return Compact, compact_values(world_size) if self.wire == "compact" else None
        return (Fixed if self.index_message == "fixed" else Padded), None

    def wire_values(self, world_size: int | None = None) -> torch.dtype | None:
        """As :meth:`Sparsifier.wire_values`: on the compact wire int8 up to
        :data:`INT8_RANKS` ranks, bfloat16 beyond; what an entry costs follows.

        Example:
            >>> Micro(0.001).wire_values(4), Micro(0.001).wire_values(64)
            (torch.int8, torch.bfloat16)
            >>> Micro(0.001).entry_bytes(), Micro(0.001).entry_bytes(world_size=64)
            (2.494140625, 3.494140625)
            >>> Micro(0.001, wire="plain").entry_bytes()
            8
        """
        return self._wire_format(world_size)[1]

    def framing_kind(self) -> type[Framing]:
        return self._wire_format()[0]

    def framing(self) -> Framing:
        framing, values = self._wire_format(self.world_size)
        if framing is Compact:
            return Compact(_Owned(self), self.capacity, values)
        if framing is Fixed:  # a warm-up's larger k overflows the final message
            return Fixed(self.layout.numel, self.capacity, self._capacity(self.final_target))
        return Padded(self.layout.numel)

    def _part(self, step: int) -> int:
        return owned_partition(step, self.rank, self.world_size)

    def partition(self, step: int) -> tuple[int, int] | None:
        return self._partitions.range(self._part(step))

    def quota(self, step: int) -> int:
        """What this rank sends at ``step`` with ``selection="quota"``: its partition's share.

        Example:
            >>> from microsparse.layout import Layout
            >>> micro = Micro(density=0.001)
            >>> micro.bind(Layout.of([("w", torch.empty(215_370))]), rank=0, world_size=64)
            >>> [micro.quota(t) for t in range(6)]  # k / n = 215 / 64 = 3.36
            [3, 4, 3, 3, 4, 3]
        """
        return self._quota_of(self.rank, step)

    def _quota_of(self, rank: int, step: int) -> int:
        k, n = self.target, self.world_size
        share = (owned_partition(step, rank, n) + step) % n
        return (share + 1) * k // n - share * k // n

    def counts(self, step: int) -> list[int] | None:
        if self.selection != "quota" or self.index_message != "fixed":
            return None
        n = self.world_size
        return [
            min(self._quota_of(rank, step), self._partitions.size(owned_partition(step, rank, n)))
            for rank in range(n)
        ]

    @property
    def agrees(self) -> bool:
        return isinstance(self._rule, QuantileThreshold)

    @property
    def selects_from_sum(self) -> bool:  # type: ignore[override]
        return self.selection == "quota"  # a shared threshold needs |a| for its histogram

    def agreement(self, accumulated: torch.Tensor, step: int) -> torch.Tensor:
        assert isinstance(self._rule, QuantileThreshold)
        magnitude = self._owned_magnitudes(accumulated, step)
        self._magnitudes_of_step = step
        logs = self._buffer(accumulated, "_logs")
        return self._rule.histogram([magnitude], logs)

    def adopt_agreement(self, total: torch.Tensor) -> None:
        assert isinstance(self._rule, QuantileThreshold)
        self._rule.solve(total)

    def select(
        self,
        accumulated: torch.Tensor,
        step: int,
        scratch: torch.Tensor | None = None,
        addend: torch.Tensor | None = None,
        divisor: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As :meth:`Sparsifier.select`; with ``addend`` (quotas only), from |accumulated +
        addend / divisor| (the residual and the fresh gradient, unscaled by a ``GradScaler``'s
        one-element scale where given, before the engine adds them), read into a buffer
        shared by every slab on the device."""
        part = self._part(step)
        size = self._partitions.size(part)
        self._threshold = math.nan if self._rule is None else self._rule.threshold
        if size == 0:  # only when d < n
            return torch.empty(0, dtype=torch.long, device=accumulated.device)
        if addend is not None:
            shared = _shared(accumulated, self._largest)
            magnitude = self._owned_magnitudes(accumulated, step, shared, addend, divisor)
        elif self._magnitudes_of_step == step:  # this step's agreement computed them already
            magnitude = self._buffer(accumulated, "_scratch")[:size]
        else:
            magnitude = self._owned_magnitudes(accumulated, step, scratch)
        self._magnitudes_of_step = None
        if self.selection == "quota":
            quota = min(self.quota(step), size)
            if quota == 0:
                return torch.empty(0, dtype=torch.long, device=accumulated.device)
            chosen = self._finder.largest(magnitude, quota)
            self._threshold = Pending(self._finder.smallest_taken_reader())
            positions = self._partitions.positions(part, chosen)
            self._chosen = (positions, chosen)  # a compact message sends the offsets
            return positions
        assert self._rule is not None
        chosen = self._candidates.at_least(magnitude, self._rule.threshold)
        if chosen.numel() == 0:
            chosen = torch.tensor([step % size], device=accumulated.device)
        return self._partitions.positions(part, chosen)

    def largest_sent(self, positions: torch.Tensor) -> torch.Tensor | None:
        """With quotas: the largest of the magnitudes the search took (|a| as the engine
        computes it, rounded alike), where ``positions`` is what :meth:`select` just returned."""
        chosen = self._chosen
        if chosen is None or chosen[0] is not positions:
            return None
        return self._finder.largest_taken()

    def _owned_magnitudes(
        self,
        accumulated: torch.Tensor,
        step: int,
        scratch: torch.Tensor | None = None,
        addend: torch.Tensor | None = None,
        divisor: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """|a| of the owned partition (|a + addend / divisor| with ``addend``), read segment
        by segment into ``scratch`` (lent by the engine) or a buffer of its own."""
        if scratch is None or scratch.numel() < self._largest or scratch.dtype != accumulated.dtype:
            scratch = self._buffer(accumulated, "_scratch")
        part = self._part(step)
        segments = self._partitions.segments(accumulated, part)
        added = self._partitions.segments(addend, part) if addend is not None else None
        added = added if added is not None else [None] * len(segments)
        offset = 0
        segment: Segment
        for segment, more in zip(segments, added):
            count = segment.view.numel()
            out = scratch[offset : offset + count].view_as(segment.view)
            if more is None:
                torch.abs(segment.view, out=out)
            elif divisor is None:  # the same sum, rounded the same, as the engine's a = e + g
                torch.add(segment.view, more.view, out=out).abs_()
            else:  # e + g / scale, as the engine's fused kernel rounds it
                torch.addcdiv(segment.view, more.view, divisor, out=out).abs_()
            offset += count
        return scratch[:offset]

    def _buffer(self, like: torch.Tensor, name: str) -> torch.Tensor:
        """A buffer as long as the largest partition, made once per name."""
        buffer = getattr(self, name, None)
        if buffer is None or buffer.device != like.device:
            buffer = torch.empty(self._largest, dtype=like.dtype, device=like.device)
            setattr(self, name, buffer)
        return buffer

    def update(self, selected: int) -> None:
        if isinstance(self._rule, ThresholdController):
            self._rule.update(selected)

    @property
    def threshold(self) -> float | Pending:
        return self._threshold

    def settle(self, threshold: float) -> bool:
        if not isinstance(self._rule, ThresholdController):
            return False  # quotas carry no threshold; the quantile rule estimates its own
        self._rule.threshold = float(threshold)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {} if self._rule is None else self._rule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._rule is not None:
            self._rule.load_state_dict(state)


def _check_wire(wire: str, selection: str, index_message: str) -> None:
    """Refuse, by name and with the fix, a wire that these options cannot carry."""
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {', '.join(WIRES)}; got {wire!r}")
    if wire == "plain":
        return
    if selection != "quota":
        raise ValueError(
            f"wire={wire!r} needs selection='quota': its message has room for a count known "
            "before the exchange; with a shared threshold keep wire='plain'"
        )
    if index_message != "fixed":
        raise ValueError(
            f"wire={wire!r} replaces the fixed index message: leave index_message='fixed' "
            "(or keep wire='plain' for the reference's padded message)"
        )


_shared_buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _shared(like: torch.Tensor, size: int) -> torch.Tensor:
    """A magnitude buffer of at least ``size`` entries, one per device and dtype for every
    slab: selecting from e + g happens before the step's first collective, one slab after
    another on the thread (and, on a GPU, the stream) that starts the steps, and nothing
    reads the buffer once the selection is made."""
    key = (like.device, like.dtype)
    buffer = _shared_buffers.get(key)
    if buffer is None or buffer.numel() < size:
        buffer = _shared_buffers[key] = torch.empty(size, dtype=like.dtype, device=like.device)
    return buffer


class _Owned:
    """MiCRO's owned partitions as the ranges of a :class:`~microsparse.comm.framing.Compact`
    message: rank r's positions at step t are offsets into partition (t + r) mod n.

    A partition is rows of entries (interleaved: its blocks; contiguous: one row), so every
    rank's offsets map to flat positions through one table of row bases (offset i is at its
    row's base plus i), the ranks' tables end to end: a handful of kernels whatever n. The
    per-pick rows are made once per pattern of owners and counts (they rotate with the step:
    a few per rank)."""

    def __init__(self, micro: Micro) -> None:
        self._micro = micro
        self._partitions = micro._partitions
        self._rank, self._world_size = micro.rank, micro.world_size
        self.largest = micro._largest
        self._plans: dict[tuple[int, tuple[int, ...], torch.device], tuple[torch.Tensor, ...]] = {}

    def offsets(self, step: int, positions: torch.Tensor) -> torch.Tensor:
        chosen = self._micro._chosen
        if chosen is not None and chosen[0] is positions:  # what select() just found
            return chosen[1]
        part = owned_partition(step, self._rank, self._world_size)
        return self._partitions.offsets(part, positions)

    def positions(self, step: int, offsets: torch.Tensor, counts: list[int]) -> torch.Tensor:
        row, table, first, last, zero = self._plan(step, counts, offsets.device)
        # Outside a rank's range only where every rank is answered this rank's message
        # (SymmetricPeers' timings): past its count (below 0) or past a shorter partition.
        offsets = torch.clamp(offsets, zero, last)
        if row & (row - 1):
            rows = torch.div(offsets, row, rounding_mode="floor")
        else:
            rows = torch.bitwise_right_shift(offsets, row.bit_length() - 1)
        return table.index_select(0, rows.add_(first)).add_(offsets)

    def _plan(self, step: int, counts: list[int], device: torch.device) -> tuple[Any, ...]:
        n = self._world_size
        key = (step % n, tuple(counts), device)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 4 * n:
                self._plans.clear()
            parts = [owned_partition(step, rank, n) for rank in range(n)]
            tables = [self._partitions.rows(part) for part in parts]
            row = tables[0][0]
            begins = torch.tensor([0] + [len(bases) for _, bases in tables[:-1]]).cumsum(0)
            sizes = torch.tensor([self._partitions.size(part) for part in parts])
            repeats = torch.tensor(counts)
            first = torch.repeat_interleave(begins, repeats).to(device)
            last = torch.repeat_interleave(sizes - 1, repeats).to(device)
            table = torch.cat([bases for _, bases in tables]).to(device)
            zero = torch.zeros((), dtype=torch.long, device=device)
            plan = self._plans[key] = (row, table, first, last, zero)
        return plan
