"""How the selected positions travel: the index message of one step, framed four ways.

Every rank proposes positions; a framing turns them into the collectives that let every rank
learn all positions, and back into one position list that is identical on every rank:

- :class:`Padded`: the reference's way. An all-gather of ``[step, count]`` headers, then of
  the indices, each rank's padded to the largest count (gloo's all-gather needs equal sizes).
  With ``union=True`` the positions are deduplicated (sparsifiers whose picks may overlap).
- :class:`FixedUnion`: the union with no size that depends on the data, for ranks that each
  pick a known number of positions that may overlap (top-k): every rank's picks in one
  all-gather, all n·k of them averaged, a position several ranks picked summed once.
- :class:`Fixed`: one all-gather of a fixed-capacity message that carries its own header
  (count, step, proposals): one round instead of two. A rank with more proposals than slots
  sends its largest and keeps the rest in the residual. A density warm-up's extra slots
  follow in a second round. Where every rank's count is known before the exchange (MiCRO's
  quotas), the positions are decoded without reading anything back to the host.
- :class:`Compact`: as ``Fixed`` with every count known, for positions that each lie in a
  range of the rank's own that every rank knows (MiCRO's owned partition): offsets into it in
  Elias–Fano form (``comm/eliasfano.py``), about 2 + log2(1 / density) bits each (10.1 at
  0.35 %) instead of ``Fixed``'s 32. The values then travel as the wire chooses (8-bit
  integers on a shared scale up to 16 ranks) unless the user names a dtype.
- :class:`Shared`: every rank already holds the same positions (a leader's plan); only the
  step is checked.
- :class:`Dense`: no indices; every entry is averaged.

Each framing also lists its collectives for a message of a given size
(:meth:`Framing.collectives`), which is all the cost model needs. Where a framing's first
round carries a header of counts, it also checks the step there: a rank at another step
raises ``ConfigMismatchError`` on every rank, because the header of every rank reaches every
rank in the same round (the engine's guard checks the step of every step anyway).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Generator
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from microsparse.comm.collectives import Collective, Kind, check_steps, index_dtype
from microsparse.comm.eliasfano import EliasFano, position_bits
from microsparse.comm.slots import KeptSlots
from microsparse.errors import ConfigMismatchError

Exchange = Generator[Collective, torch.Tensor, "Exchanged"]


@dataclass(frozen=True)
class Proposal:
    """What one rank brings to the index exchange of one step."""

    local: torch.Tensor
    """Positions this rank proposes (int64, distinct)."""
    accumulated: torch.Tensor
    """The flat accumulated gradient a (to keep the largest when a message is full)."""
    step: int
    counts: list[int] | None = None
    """Every rank's count, when known before the exchange (a leader's plan, quotas)."""
    guard: torch.Tensor | None = None
    """The engine's guard message ([flag, step], float32) to carry in the index message, where
    the framing can (:attr:`Framing.carries_guard`): the step then needs no round of its own."""
    value_scale: torch.Tensor | None = None
    """Where the values travel as 8-bit integers: this rank's largest |value| at its own
    positions (float32, one element), carried in the index message
    (:attr:`Framing.carries_scale`) so that every rank quantises with the same scale."""


@dataclass(frozen=True)
class Exchanged:
    """What the index exchange gave: identical on every rank except ``local_selected``."""

    positions: torch.Tensor
    """All positions to average (int64), identical on every rank."""
    local_selected: int
    """Positions this rank sent."""
    message_slots: int
    """Indices per rank in the index message (the largest count, or the fixed capacity; for
    ``Compact``, the 16-bit halves of its code's words)."""
    proposed: int
    """Σ_r of every rank's proposals, before deduplication or the capacity cut."""
    local_proposed: int
    """This rank's proposals, before the capacity cut."""
    guard_rows: torch.Tensor | None = None
    """Every rank's guard message as carried in the index message, (n, 2): its whole numbers
    in the message's own int32 words (compared with float32 rows without a copy)."""
    scale_rows: torch.Tensor | None = None
    """Every rank's :attr:`Proposal.value_scale`, (n,) float32, where one was carried."""
    repeats: torch.Tensor | None = None
    """Where ``positions`` repeats a position listed before it (bool, one per position): its
    average is written there only once (:class:`FixedUnion`)."""


class Framing(ABC):
    """One way to frame the index message; see the module docstring."""

    name: ClassVar[str]
    header_slots: ClassVar[int] = 0
    """Index slots of the message that carry its header instead of positions."""
    decodes_known_counts: ClassVar[bool] = False
    """Given every rank's count before the exchange, it reads nothing back to the host."""
    carries_guard: ClassVar[bool] = False
    """Its message has room for the engine's guard ([flag, step]): a step whose sparsifier
    selects before the residual is written then takes no guard round of its own."""
    carries_scale: ClassVar[bool] = False
    """Its message has room for each rank's :attr:`Proposal.value_scale`: the values may
    travel as 8-bit integers (``value_dtype=torch.int8``)."""
    value_dtype: torch.dtype | None = None
    """The values' wire dtype where the user names none (None: the gradient's own)."""
    position_bytes: ClassVar[int] = 4
    """Nominal bytes of one position on the wire (an int32 index), whatever d and n: headers
    and padding are left out (see :meth:`entry_bytes`)."""

    @classmethod
    def entry_bytes(cls, value_dtype: torch.dtype | None = None, density: float = 1.0) -> float:
        """Nominal bytes of one sent entry where a rank sends ``density`` of the entries: its
        position (:attr:`position_bytes`, or what a compact offset costs at that density) and
        its value as ``value_dtype`` (float32 where None, the bytes dense averaging sends per
        entry).

        The one place a byte budget (``SparseOptions(budget=...)``) is priced. What it leaves
        out is small and does not grow with k: a fixed message's 3-slot header, a padded
        message's count round, the guard's 8 bytes a rank (and an int8 step's scale, 4 more),
        the last share's slot of padding, and the rounding of a compact message to whole
        words. ``StepStats.payload_bytes`` counts all of it.

        Example:
            >>> Fixed.entry_bytes(), Fixed.entry_bytes(torch.bfloat16)
            (8, 6)
            >>> round(Compact.entry_bytes(torch.int8, density=1 / 256), 3), Dense.entry_bytes()
            (2.25, 4)
        """
        values = torch.float32 if value_dtype is None else value_dtype
        return cls.position_bytes + values.itemsize

    @classmethod
    def density_for(cls, entry_budget: float, value_dtype: torch.dtype | None = None) -> float:
        """The density whose entries cost ``entry_budget`` bytes per gradient entry: density ·
        :meth:`entry_bytes` at that density (a budget times dense's 4 bytes an entry).

        Example:
            >>> Fixed.density_for(0.008), round(Compact.density_for(0.008, torch.int8), 6)
            (0.001, 0.003535)
        """
        return entry_budget / cls.entry_bytes(value_dtype)

    @classmethod
    def check_value_dtype(cls, value_dtype: torch.dtype | None, sparsifier: str) -> None:
        """Refuse values this wire cannot carry: 8-bit integers need the scale in the message
        (:attr:`carries_scale`)."""
        if value_dtype == torch.int8 and not cls.carries_scale:
            raise ValueError(
                "value_dtype=torch.int8 needs an index message that carries the values' "
                f"scale, which {sparsifier!r} on its {cls.name} wire has not: use MiCRO on its "
                "compact wire (the default), or value_dtype=torch.bfloat16"
            )

    @abstractmethod
    def exchange(self, proposal: Proposal, world_size: int) -> Exchange:
        """Yield the collectives that share ``proposal``; return what they gave."""

    @classmethod
    @abstractmethod
    def collectives(
        cls, slots: float, index_bytes: int, counts_known: bool = False
    ) -> list[tuple[Kind, float]]:
        """(kind, bytes per rank's message) of the index exchange, for ``slots`` indices per
        rank (the largest count, or the capacity); ``counts_known`` when a plan fixed them."""


class _Positions:
    """Decodes (n, slots) index rows with a count per rank into one position list."""

    def __init__(self) -> None:
        self._slot = torch.empty(0, dtype=torch.long)
        self._kept = KeptSlots()

    def decode(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        n, slots = rows.shape
        if slots == 0:
            return torch.empty(0, dtype=torch.long, device=rows.device)
        if all(count == slots for count in counts):
            return rows.reshape(-1).long()
        if self._slot.numel() < slots or self._slot.device != rows.device:
            self._slot = torch.arange(max(slots, 2 * self._slot.numel()), device=rows.device)
        limits = torch.tensor(counts, device=rows.device).unsqueeze(1)
        return rows[self._slot[:slots].unsqueeze(0) < limits].long()

    def decode_known(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """As :meth:`decode`, for counts the host knew before the exchange: the slots to keep
        are a gather whose index is made once per pattern of counts, so nothing is read back."""
        n, slots = rows.shape
        if all(count == slots for count in counts):
            return rows.reshape(-1).long()
        keep = self._kept.index(counts, slots, device=rows.device)
        return rows.reshape(-1).index_select(0, keep).long()


def _count_header(proposal: Proposal) -> Generator[Collective, torch.Tensor, list[int]]:
    """All-gather ``[step, count]`` of every rank: check the steps, return the counts."""
    header = torch.tensor([proposal.step, proposal.local.numel()], device=proposal.local.device)
    rows = (yield Collective("all_gather", header, "header")).tolist()
    check_steps([row[0] for row in rows])
    return [row[1] for row in rows]


class Padded(Framing):
    """Header round, then indices padded to the largest count; ``union`` deduplicates.

    Example:
        >>> Padded.collectives(slots=300, index_bytes=4)
        [('all_gather', 16), ('all_gather', 1200)]
    """

    name = "padded"

    def __init__(self, numel: int, union: bool = False) -> None:
        self.union = union
        self.dtype = index_dtype(numel)
        self._message = torch.empty(0, dtype=self.dtype)
        self._decoder = _Positions()

    @property
    def label(self) -> str:
        return "union" if self.union else self.name

    def exchange(self, proposal: Proposal, world_size: int) -> Exchange:
        local = proposal.local
        counts = proposal.counts
        if counts is None:
            counts = yield from _count_header(proposal)
        longest = max(counts)
        message = self._buffer(longest, local.device)
        message[: local.numel()] = local
        message[local.numel() :] = 0  # what is not a position must not leak
        rows = yield Collective("all_gather", message, "indices")
        positions = self._decoder.decode(rows, counts)
        if not self.union:
            return Exchanged(positions, local.numel(), longest, sum(counts), local.numel())
        return self._merged(positions, local.numel(), longest, sum(counts))

    def _merged(self, positions: torch.Tensor, local: int, slots: int, proposed: int) -> Exchanged:
        """The union of every rank's ``positions``, each once (its size is the data's)."""
        return Exchanged(torch.unique(positions, sorted=True), local, slots, proposed, local)

    def _buffer(self, length: int, device: torch.device) -> torch.Tensor:
        if self._message.numel() < length or self._message.device != device:
            self._message = torch.empty(max(length, 2 * self._message.numel()),
                                        dtype=self.dtype, device=device)  # fmt: skip
        return self._message[:length]

    @classmethod
    def collectives(
        cls, slots: float, index_bytes: int, counts_known: bool = False
    ) -> list[tuple[Kind, float]]:
        header: list[tuple[Kind, float]] = [] if counts_known else [("all_gather", 2 * 8)]
        return header + [("all_gather", slots * index_bytes)] if slots else header


class FixedUnion(Padded):
    """The union as a fixed message: every rank's k positions in one all-gather of k indices,
    and all n·k of them averaged, a position that several ranks picked summed only once.

    ``Padded(union=True)`` deduplicates the positions (``torch.unique``), so the values'
    all-reduce has the union's size K, which only the data decides: the host must read it.
    Here the counts are known (k a rank), nothing is deduplicated, and the values' all-reduce
    always has n·k slots: a position several ranks picked fills one slot per pick, each
    holding that position's sum over the ranks, and all but the first are marked in
    :attr:`Exchanged.repeats` (one sort of n·k indices), so that its average is written
    once. Every rank sends the same values as with the union, at n·k / K times its bytes;
    nothing is read back to the host. The residuals are the union's bit for bit; the
    averages too with 2 ranks, and beyond to the all-reduce's order of summation, which
    follows the slot. Where DDP leaves out the parameters a rank did not use, that rank
    keeps its k slots and sends 0 at every position inside them, keeping its residual there
    (as with a leader's plan), where the union would send its residual at another rank's
    picks there; such a step reads its guard on the host. The sparsifier is not told the
    union's size (:meth:`~microsparse.sparsifiers.Sparsifier.update`): that would read it.

    Example:
        >>> FixedUnion.collectives(slots=300, index_bytes=4)
        [('all_gather', 1200)]
    """

    name = "fixed_union"
    label = "fixed_union"
    decodes_known_counts = True

    def __init__(self, numel: int) -> None:
        super().__init__(numel, union=True)

    @classmethod
    def collectives(
        cls, slots: float, index_bytes: int, counts_known: bool = False
    ) -> list[tuple[Kind, float]]:
        """Every rank's count is k, known before the exchange (``counts_known`` is not read):
        no header round."""
        return Padded.collectives(slots, index_bytes, counts_known=True)

    def _merged(self, positions: torch.Tensor, local: int, slots: int, proposed: int) -> Exchanged:
        ordered, order = torch.sort(positions, stable=True)
        repeated = torch.zeros_like(positions, dtype=torch.bool)
        torch.eq(ordered[1:], ordered[:-1], out=repeated[1:])
        repeats = torch.empty_like(repeated).index_put_((order,), repeated)
        return Exchanged(positions, local, slots, proposed, local, repeats=repeats)


class Fixed(Framing):
    """One all-gather of ``header_slots + base`` slots per rank, header included.

    The size of that round never changes: a rank whose step counter disagrees must still
    meet the others in an equal-sized all-gather, so that the header can report the
    disagreement instead of gloo aborting. During a density warm-up the capacity is larger
    than ``base`` (the capacity at the final k); the slots beyond it travel in a second
    all-gather, sent only once the header has shown every rank at the same step, hence at the
    same capacity.

    Example:
        >>> Fixed.collectives(slots=100, index_bytes=4)   # 3 header slots + 100 indices
        [('all_gather', 412)]
    """

    name = "fixed"
    label = "fixed"
    header_slots = 3  # count, step, proposals
    decodes_known_counts = True
    _COUNT, _STEP, _PROPOSED = 0, 1, 2

    def __init__(self, numel: int, capacity: int, base: int | None = None) -> None:
        self.dtype = index_dtype(numel)
        self.base = capacity if base is None else base
        self._message: torch.Tensor | None = None
        self._overflow: torch.Tensor | None = None
        self._decoder = _Positions()
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        """Carry ``capacity`` positions per rank from now on (never fewer than ``base``)."""
        if capacity < self.base:
            raise ValueError(f"capacity {capacity} is below the message's base {self.base}")
        self.capacity = capacity

    def exchange(self, proposal: Proposal, world_size: int) -> Exchange:
        local, accumulated = proposal.local, proposal.accumulated
        proposed = local.numel()
        if proposed > self.capacity:  # keep the largest; the rest waits in the residual
            keep = torch.topk(accumulated.index_select(0, local).abs_(), self.capacity).indices
            local = local.index_select(0, keep)
        head, base = self.header_slots, self.base
        if self._message is None or self._message.device != local.device:
            self._message = torch.zeros(head + base, dtype=self.dtype, device=local.device)
        message = self._message
        if proposal.counts is None:  # else every rank knows the counts: no header to write
            # Python numbers into a device tensor: kernel arguments, no copy from the host.
            message[self._COUNT] = local.numel()
            message[self._STEP] = proposal.step
            message[self._PROPOSED] = proposed
        first = min(local.numel(), base)
        message[head : head + first] = local[:first]
        if head + first < message.numel():
            message[head + first :] = 0  # what is not a position must not leak
        rows = yield Collective("all_gather", message, "indices")
        slots = rows[:, head:]
        if self.capacity > base:
            overflow = self._overflow_buffer(local.device)
            overflow[: local.numel() - first] = local[first:]
            overflow[local.numel() - first :] = 0
            more = yield Collective("all_gather", overflow, "indices")
            slots = torch.cat([slots, more], dim=1)
        if proposal.counts is not None:  # known to every rank before: nothing to read back
            counts = proposal.counts
            positions = self._decoder.decode_known(slots, counts)
            return Exchanged(positions, local.numel(), self.capacity, sum(counts), proposed)
        header = rows[:, :head].tolist()
        counts = [row[self._COUNT] for row in header]
        positions = self._decoder.decode(slots, counts)
        proposals = sum(row[self._PROPOSED] for row in header)
        return Exchanged(positions, local.numel(), self.capacity, proposals, proposed)

    def _overflow_buffer(self, device: torch.device) -> torch.Tensor:
        extra = self.capacity - self.base
        overflow = self._overflow
        if overflow is None or overflow.numel() < extra or overflow.device != device:
            self._overflow = torch.empty(extra, dtype=self.dtype, device=device)
        return self._overflow[:extra]

    @classmethod
    def collectives(
        cls, slots: float, index_bytes: int, counts_known: bool = False
    ) -> list[tuple[Kind, float]]:
        return [("all_gather", (cls.header_slots + slots) * index_bytes)]


class OwnedRanges(Protocol):
    """Where every rank's positions lie at a step: one range each of known size, whose
    entries are numbered 0, 1, ... (a partition that may be strided in the flat vector)."""

    largest: int
    """Entries of the largest range."""

    def offsets(self, step: int, positions: torch.Tensor) -> torch.Tensor:
        """This rank's flat positions at ``step`` as offsets into its range (int64)."""
        ...

    def positions(self, step: int, offsets: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The inverse for every rank at once: ``offsets`` holds ``counts[r]`` offsets into
        rank r's range, rank after rank; their flat positions, in that order."""
        ...


class Compact(Framing):
    """One all-gather of every rank's offsets into its own range in Elias–Fano form
    (:class:`~microsparse.comm.eliasfano.EliasFano`), in int32 words.

    Each rank's message holds ``capacity`` offsets below the largest range's size u in
    ``capacity · l + (u - 1 >> l) + capacity`` bits (l = ⌊log2(u / capacity)⌋; about
    2 + log2(u / capacity) bits an offset, 10.1 where a rank sends 0.35 % of its range),
    rounded up to whole words; where the engine hands over its guard (:attr:`Proposal.guard`),
    its two words follow, and the step takes no guard round of its own; where the values
    travel as 8-bit integers, the rank's largest |value| (float32) takes one word more.
    ``message_slots`` counts the 16-bit halves of the code's words. The size is fixed by the
    options and the step's kind alone, so ranks at different steps still meet in equal-sized
    rounds, and the engine reads the step from the guard's words. Where the counts are not
    known (DDP leaving out unused parameters), each rank's set bits are counted on the host.

    Example:
        >>> Compact.collectives(slots=104, index_bytes=4)   # 52 words of code
        [('all_gather', 208)]
    """

    name = "compact"
    label = "compact"
    decodes_known_counts = True
    carries_guard = True
    carries_scale = True
    GUARD_WORDS = 2
    SCALE_SLOTS = 2
    """The 16-bit slots of the 32-bit word that carries an 8-bit step's scale."""

    def __init__(
        self, ranges: OwnedRanges, capacity: int, value_dtype: torch.dtype | None = torch.bfloat16
    ) -> None:
        self._ranges = ranges
        self.capacity = capacity
        self.value_dtype = value_dtype
        self._codec = EliasFano(ranges.largest, capacity)
        self.slots = 2 * self._codec.words
        self._messages: dict[int, torch.Tensor] = {}  # by length: with the guard's words or not

    @classmethod
    def entry_bytes(cls, value_dtype: torch.dtype | None = None, density: float = 1.0) -> float:
        """As :meth:`Framing.entry_bytes`: an offset costs
        :func:`~microsparse.comm.eliasfano.position_bits` (density) bits, fewer the more a
        rank sends of its range."""
        values = torch.float32 if value_dtype is None else value_dtype
        return position_bits(density) / 8 + values.itemsize

    @classmethod
    def density_for(cls, entry_budget: float, value_dtype: torch.dtype | None = None) -> float:
        """As :meth:`Framing.density_for`, solved in the range of densities that share l low
        bits, where density · bytes = density · (value + (l + 1) / 8) + 2**-l / 8 (its
        solutions join where l changes, so exactly one range holds one)."""
        values = (torch.float32 if value_dtype is None else value_dtype).itemsize
        for low in range(64):
            density = (entry_budget - 2.0**-low / 8) / (values + (low + 1) / 8)
            if density > 2.0 ** -(low + 1):
                return density
        return entry_budget / cls.entry_bytes(value_dtype, 2.0**-64)

    def exchange(self, proposal: Proposal, world_size: int) -> Exchange:
        local, step, ranges = proposal.local, proposal.step, self._ranges
        if local.numel() > self.capacity:
            raise ValueError(
                f"{local.numel()} positions proposed, but a compact message holds {self.capacity}"
            )
        words, guard, scale = self._codec.words, proposal.guard, proposal.value_scale
        size = words + (0 if guard is None else self.GUARD_WORDS) + (scale is not None)
        message = self._messages.get(size)
        if message is None or message.device != local.device:
            message = self._messages[size] = torch.zeros(size, dtype=torch.int32,
                                                         device=local.device)  # fmt: skip
        if guard is not None:  # [flag, step] are whole numbers below 2**24: exact
            message[words : words + self.GUARD_WORDS].copy_(guard)
        if scale is not None:  # its bits, in the last word
            message[-1:].copy_(scale.view(torch.int32))
        if world_size == 1:  # the same round, but no other rank to read it: nothing to code
            rows = yield Collective("all_gather", message, "indices")
            return Exchanged(local, local.numel(), self.slots, local.numel(), local.numel(),
                             *_carried(rows, words, proposal))  # fmt: skip
        self._codec.encode(ranges.offsets(step, local), out=message[:words])
        rows = yield Collective("all_gather", message, "indices")
        counts = proposal.counts if proposal.counts is not None else self._codec.counts(rows)
        positions = ranges.positions(step, self._codec.decode(rows, counts), counts)
        return Exchanged(positions, local.numel(), self.slots, sum(counts), local.numel(),
                         *_carried(rows, words, proposal))  # fmt: skip

    @classmethod
    def collectives(
        cls, slots: float, index_bytes: int, counts_known: bool = False
    ) -> list[tuple[Kind, float]]:
        """``slots``: the 16-bit halves of the code's words; ``index_bytes`` is
        not read (the code fills whole 4-byte words). A guard carried inside adds its 8 bytes here
        instead of in a round of its own."""
        return [("all_gather", 4 * math.ceil(slots / 2))]


def _carried(
    rows: torch.Tensor, words: int, proposal: Proposal
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Every rank's [flag, step] and value scale from the gathered messages, where they
    carried them (:attr:`Exchanged.guard_rows`, :attr:`Exchanged.scale_rows`)."""
    table = rows.view(-1, rows.shape[-1])
    guard = None
    if proposal.guard is not None:
        guard = table[:, words : words + Compact.GUARD_WORDS]
    scale = None if proposal.value_scale is None else table[:, -1].view(torch.float32)
    return guard, scale


class Shared(Framing):
    """Every rank holds the same positions; a header round checks the step unless a plan did.

    Example:
        >>> Shared.collectives(slots=0, index_bytes=4, counts_known=True)
        []
    """

    name = "shared"
    label = "shared"
    position_bytes = 4  # the leader's plan carries them, as int32

    def exchange(self, proposal: Proposal, world_size: int) -> Exchange:
        local = proposal.local
        counts = proposal.counts
        if counts is None:
            counts = yield from _count_header(proposal)
        if len(set(counts)) > 1:
            raise ConfigMismatchError(
                f"the ranks must select the same positions, but their counts are {counts}"
            )
        return Exchanged(local, local.numel(), local.numel(), local.numel(), local.numel())

    @classmethod
    def collectives(
        cls, slots: float, index_bytes: int, counts_known: bool = False
    ) -> list[tuple[Kind, float]]:
        return [] if counts_known else [("all_gather", 2 * 8)]


class Dense(Framing):
    """No indices: every entry is averaged (the engine's guard has checked the step).

    Example:
        >>> Dense.collectives(slots=0, index_bytes=4)
        []
    """

    name = "dense"
    label = "dense"
    position_bytes = 0  # every entry, in order

    @classmethod
    def check_value_dtype(cls, value_dtype: torch.dtype | None, sparsifier: str) -> None:
        """Any: a dense average sends the gradient's own dtype."""

    def exchange(self, proposal: Proposal, world_size: int) -> Exchange:
        yield from ()  # nothing to exchange: the values are the whole vector
        numel = proposal.accumulated.numel()
        return Exchanged(proposal.local, numel, 0, numel, numel)

    @classmethod
    def collectives(
        cls, slots: float, index_bytes: int, counts_known: bool = False
    ) -> list[tuple[Kind, float]]:
        return []
