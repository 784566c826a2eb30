"""The contract between the engine and a sparsifier: *what* is selected.

A sparsifier only decides which positions of the error-feedback-accumulated flat vector this
rank proposes for sending, and how its index message is framed (:meth:`Sparsifier.framing`,
from ``microsparse.comm.framing``). The engine (``microsparse.engine``) does everything else:
accumulation and residuals, the collectives, and writing the averaged gradient.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from microsparse.comm.framing import Dense, Framing
from microsparse.layout import Layout


def validate_density(density: float) -> float:
    """Return ``density`` as a float, or raise naming the argument and the valid range."""
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise TypeError(f"density must be a number in (0, 1], got {density!r}")
    density = float(density)
    if not math.isfinite(density) or not 0.0 < density <= 1.0:
        raise ValueError(
            f"density must be in (0, 1] (e.g. 0.001 sends 0.1 % of the gradient), got {density!r}"
        )
    return density


class Sparsifier(ABC):
    """Base class of every sparsifier in the registry: one file and ``@register_sparsifier``.

    **Required**: ``name``, :meth:`framing` and :meth:`select`; constructor keyword arguments
    are the user-facing options (``GradientReducer(..., threshold_rule="as_coded")``), stored
    under their own names, where :meth:`options` reads them back for the ranks' check.

    **Optional**, each group all or nothing:

    - *adapting over time*: :meth:`update` and the :meth:`state_dict` pair;
    - *counts known before the data*: :meth:`counts` (the engine then never reads back);
    - *an all-ranks sum first*: :attr:`agrees`, :meth:`agreement`, :meth:`adopt_agreement`;
    - *a leader's plan*: ``planned = True``, :meth:`empty_plan`, :meth:`make_plan`,
      :meth:`adopt_plan` (and :meth:`leader`, cyclic by default). Each step the engine calls
      ``make_plan`` on the leader only, broadcasts that fixed-size tensor, and calls
      ``adopt_plan`` on every rank before ``select``; it returns every rank's count;
    - *selecting from a = e + g before it is written*: :attr:`selects_from_sum` and
      ``select(residual, step, addend=gradient, divisor=scale)`` (from |e + g / scale|,
      ``divisor`` None or a ``GradScaler``'s one-element scale). The engine then selects
      before it updates the residual, so that the guard's flags ride in the index message
      (one round less) and a step skipped after that round has changed nothing;
    - *the largest |a| it sent, found while selecting*: :meth:`largest_sent` (the engine
      then need not read it again for an 8-bit step's scale);
    - *reporting*: :meth:`report`, :attr:`threshold`, :meth:`partition`;
    - *benchmarks*: :meth:`settle` (start from a given threshold).

    **Rules** (the engine relies on them): a sparsifier is planned or agrees, never both
    (the engine refuses it); :meth:`framing` is pure, the same answer at every call and no
    change of state (the hook and the cost model read the step's shape from it); what
    :meth:`state_dict` returns is a snapshot, not live tensors (the engine keeps it to roll
    a failed step back); :meth:`select` returns distinct positions.
    """

    name: ClassVar[str]
    framing_class: ClassVar[type[Framing] | None] = None
    """The class of what :meth:`framing` returns, where the options do not choose it: what
    :meth:`entry_bytes` prices."""
    planned: ClassVar[bool] = False
    selects_from_sum: bool = False
    """Whether :meth:`select` takes ``addend=`` and ``divisor=``: it then selects from
    residual + addend / divisor."""
    yardstick: ClassVar[bool] = False
    """A bound to measure methods against (``oracle``), left out of the benchmarks' defaults."""
    layout: Layout
    """The slab's parameters (set by :meth:`bind`, as are the attributes below)."""
    rank: int
    """This rank's place among the ranks that average this slab."""
    world_size: int
    """The number of ranks n."""
    target: int
    """k for this slab at the current step (a density warm-up moves it: :meth:`retarget`)."""
    final_target: int
    """k once any warm-up is over."""

    def __init__(self, density: float) -> None:
        self.density = validate_density(density)

    def bind(self, layout: Layout, rank: int, world_size: int, target: int | None = None) -> None:
        """Called once by the driver before the first step, for one slab of parameters.

        ``target`` is k for this slab; by default max(1, ⌊density · d⌋).
        """
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.target = max(1, math.floor(self.density * layout.numel)) if target is None else target
        self.final_target = self.target

    def retarget(self, target: int) -> None:
        """Send about ``target`` entries from this step on (a density warm-up moves k).

        Subclasses whose state derives from k (a capacity, a threshold rule) update it here.
        """
        self.target = target

    @property
    def current_density(self) -> float:
        """The density this step aims at: ``density``, or more during a warm-up."""
        return self.density * self.target / self.final_target

    @abstractmethod
    def framing(self) -> Framing:
        """How this sparsifier's index message travels (after :meth:`bind`)."""

    def entry_bytes(
        self, value_dtype: torch.dtype | None = None, world_size: int | None = None
    ) -> float:
        """Nominal bytes of one entry this sparsifier sends, known from its options and the
        number of ranks (None: not known yet) before :meth:`bind`: its framing's position at
        this density and the value as ``value_dtype``, or as the framing chooses on
        ``world_size`` ranks (:meth:`Framing.entry_bytes`).

        Example:
            >>> from microsparse.sparsifiers import create_sparsifier
            >>> create_sparsifier("topk", 0.01).entry_bytes(torch.float16)
            6
        """
        chosen = self.wire_values(world_size) if value_dtype is None else value_dtype
        return self.framing_kind().entry_bytes(chosen, self.density)

    def density_for(
        self, budget: float, value_dtype: torch.dtype | None = None, world_size: int | None = None
    ) -> float:
        """The density whose entries cost ``budget`` of dense averaging's bytes (4 an entry)
        on this sparsifier's wire, its values as :meth:`entry_bytes` says: where a position
        costs less the more are sent (MiCRO's compact offsets), the two are solved together.

        Example:
            >>> from microsparse.sparsifiers import create_sparsifier
            >>> create_sparsifier("topk", 1.0).density_for(0.002)   # int32 + float32
            0.001
        """
        chosen = self.wire_values(world_size) if value_dtype is None else value_dtype
        return self.framing_kind().density_for(budget * Dense.entry_bytes(), chosen)

    def wire_values(self, world_size: int | None = None) -> torch.dtype | None:
        """The dtype this sparsifier's values travel in where the user names none, on
        ``world_size`` ranks (None: not known yet): None, the gradient's own, unless its
        wire chooses one (MiCRO's compact wire: int8 up to 16 ranks, bfloat16 beyond).

        Example:
            >>> from microsparse.sparsifiers import create_sparsifier
            >>> create_sparsifier("topk", 0.01).wire_values(4) is None
            True
        """
        return None

    def framing_kind(self) -> type[Framing]:
        """The class of :meth:`framing`, known from the options alone (before :meth:`bind`):
        :attr:`framing_class`. A sparsifier whose options choose its framing overrides this."""
        if self.framing_class is None:
            raise TypeError(
                f"sparsifier {self.name!r} does not state its framing_class, so a byte budget "
                "cannot price its entries (nor int8 values find their scale's room): give "
                "density instead, or set framing_class"
            )
        return self.framing_class

    @abstractmethod
    def select(
        self, accumulated: torch.Tensor, step: int, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Distinct flat positions (int64, any order) this rank proposes to send at ``step``.

        ``scratch``, if given, is a flat buffer of at least d entries of ``accumulated``'s
        dtype that the sparsifier may overwrite during this call (the engine lends the fresh
        gradient's, consumed by then), so that it need not keep one of its own."""

    def update(self, selected: int) -> None:
        """Observe the global selected count K of the step that just ended."""

    def counts(self, step: int) -> list[int] | None:
        """Every rank's count at ``step``, where the options fix it before any data is seen
        (then :meth:`select` returns exactly this rank's count): the engine can then run the
        step without reading anything back to the host. None: counts depend on the data."""
        return None

    @property
    def agrees(self) -> bool:
        """Whether every step begins with an all-ranks sum (:meth:`agreement`): fixed by the
        options, never by the data, because every rank must take part in it."""
        return False

    def agreement(self, accumulated: torch.Tensor, step: int) -> torch.Tensor:
        """A small vector to sum over all ranks before ``select`` (e.g. a histogram).

        Called only if :attr:`agrees`. The engine all-reduces it and hands the sum to
        :meth:`adopt_agreement`, so that every rank can derive the same parameters of this
        step's selection from everyone's data.
        """
        raise NotImplementedError(f"{self.name} asks for no agreement")

    def adopt_agreement(self, total: torch.Tensor) -> None:
        """Take the all-ranks sum of this step's :meth:`agreement` vectors."""
        raise NotImplementedError(f"{self.name} asks for no agreement")

    def leader(self, step: int) -> int:
        """The rank that makes the plan at ``step`` (planned sparsifiers): cyclic, t mod n."""
        return step % self.world_size

    def empty_plan(self, device: torch.device) -> torch.Tensor:
        """A tensor of the plan's fixed shape and dtype, which the broadcast fills."""
        raise NotImplementedError(f"{self.name} is not a planned sparsifier")

    def make_plan(self, accumulated: torch.Tensor, step: int) -> torch.Tensor:
        """The leader's plan for ``step``, shaped like :meth:`empty_plan`. Leader only."""
        raise NotImplementedError(f"{self.name} is not a planned sparsifier")

    def adopt_plan(self, plan: torch.Tensor, step: int) -> list[int]:
        """Take the broadcast plan; return how many positions each rank will select."""
        raise NotImplementedError(f"{self.name} is not a planned sparsifier")

    def largest_sent(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The largest |a| at ``positions``, if they are what :meth:`select` just returned
        and it found that magnitude on the way (one element, on the device); None: the engine
        reads |a| there itself. It must be that value bit for bit."""
        return None

    def report(self) -> dict[str, Any]:
        """Sparsifier-specific values of the step just selected, for ``StepStats.extra``."""
        return {}

    @property
    def threshold(self) -> Any:
        """The selection threshold of the step just selected, NaN if it has none: a number,
        a 0-d tensor, or a :class:`~microsparse.stats.Pending` read only when asked for."""
        return math.nan

    def settle(self, threshold: float) -> bool:
        """Start from ``threshold`` instead of its own initial value, if it carries one from step
        to step (for benchmarks that time the working point). Returns whether it took it."""
        return False

    def partition(self, step: int) -> tuple[int, int] | None:
        """The range this rank selects from at ``step``, if the sparsifier partitions."""
        return None

    @classmethod
    def option_names(cls) -> list[str]:
        """The constructor's keyword options (everything but ``density``)."""
        names = inspect.signature(cls.__init__).parameters
        return [name for name in names if name not in ("self", "density")]

    def options(self) -> dict[str, Any]:
        """User-facing options, for checking that all ranks agree and for reports."""
        return {name: getattr(self, name) for name in self.option_names()}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Candidates:
    """Positions i of a contiguous 1-D vector with ``magnitude[i] >= threshold``, NaN included.

    A NaN counts as at least any threshold: it is then selected and sent, and the engine sees
    it in the sum on every rank instead of it hiding in a residual.

    When few entries pass, comparing every entry is wasted work (a boolean per entry is the
    slowest thing a CPU compare writes). The vector is cut into chunks of ``LANES · DEPTH``
    entries, and block (c, l) is the ``DEPTH`` entries of chunk c at lane l, l + LANES, ...:
    the maxima of all blocks are one vectorised reduction over the chunks' rows, at about the
    cost of one read pass, and only the blocks whose maximum passes are compared entry by entry.

    Example:
        >>> candidates = Candidates()
        >>> candidates.at_least(torch.tensor([0.5, float("nan"), 0.1, 3.0]), 0.4).tolist()
        [0, 1, 3]
    """

    LANES, DEPTH = 64, 32
    CHUNK = LANES * DEPTH
    SMALL = 64 * 1024
    """Vectors shorter than this are compared entry by entry."""
    SPARSE = 1 / 64
    """Below this fraction of passing entries the block maxima are used."""

    def __init__(self) -> None:
        self._maxima = torch.empty(0)
        self._below = torch.empty(0, dtype=torch.bool)  # which blocks' maxima fail, reused
        self._depth = torch.arange(self.DEPTH) * self.LANES
        self._sparse = True

    def maxima(self, magnitude: torch.Tensor) -> torch.Tensor:
        """The maximum of every block (NaN if it holds one), block (c, l) at c · LANES + l."""
        chunks = magnitude.numel() // self.CHUNK
        if self._maxima.numel() < chunks * self.LANES or self._maxima.device != magnitude.device:
            self._maxima = torch.empty(chunks * self.LANES, dtype=magnitude.dtype,
                                       device=magnitude.device)  # fmt: skip
            self._below = torch.empty(chunks * self.LANES, dtype=torch.bool,
                                      device=magnitude.device)  # fmt: skip
            self._depth = self._depth.to(magnitude.device)
        grid = magnitude[: chunks * self.CHUNK].view(chunks, self.DEPTH, self.LANES)
        maxima = self._maxima[: chunks * self.LANES]
        torch.amax(grid, dim=1, out=maxima.view(chunks, self.LANES))
        return maxima

    def at_least(
        self, magnitude: torch.Tensor, threshold: float, maxima: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Positions (any order) of the entries >= ``threshold`` or NaN; ``maxima`` from
        :meth:`maxima` of this same ``magnitude`` if already computed."""
        size = magnitude.numel()
        if maxima is None and (not self._sparse or size < self.SMALL):
            found = passing(magnitude, threshold)
        else:
            if maxima is None:
                maxima = self.maxima(magnitude)
            # passing(maxima, threshold) in a kept buffer: nothing of d/32 made each step
            below = self._below[: maxima.numel()]
            torch.lt(maxima, threshold, out=below)
            hit = torch.nonzero(below.logical_not_()).squeeze(1)
            # First entry of each hit block, then its DEPTH entries LANES apart.
            first = torch.div(hit, self.LANES, rounding_mode="floor").mul_(self.CHUNK).add_(
                hit % self.LANES
            )
            entries = (first.unsqueeze(1) + self._depth).view(-1)
            inside = passing(magnitude.index_select(0, entries), threshold)
            found = entries.index_select(0, inside)
            covered = maxima.numel() // self.LANES * self.CHUNK
            if covered < size:  # after the last full chunk
                tail = passing(magnitude[covered:], threshold).add_(covered)
                found = torch.cat([found, tail])
        self._sparse = found.numel() < self.SPARSE * max(size, 1)
        return found


def passing(values: torch.Tensor, threshold: float) -> torch.Tensor:
    """Positions of ``values`` (1-D) that are >= ``threshold`` or NaN, ascending."""
    return torch.nonzero(~(values < threshold)).squeeze(1)


class Magnitudes:
    """|a| over a whole vector in a reused buffer, for whole-vector selection.

    Allocating d floats every step costs page faults comparable to the selection itself,
    so the magnitude and mask buffers are made once and reused.

    Example:
        >>> buffers = Magnitudes()
        >>> magnitude = buffers.of(torch.tensor([0.5, -2.0, 0.1, 3.0]))
        >>> buffers.at_least(magnitude, 1.0).tolist(), buffers.count_at_least(magnitude, 0.2)
        ([1, 3], 3)
    """

    def __init__(self) -> None:
        self._magnitude: torch.Tensor | None = None
        self._candidates = Candidates()

    def of(self, values: torch.Tensor) -> torch.Tensor:
        """|values|, written into the reused buffer (valid until the next call)."""
        if self._magnitude is None or self._magnitude.shape != values.shape:
            self._magnitude = torch.empty_like(values)
        return torch.abs(values, out=self._magnitude)

    def count_at_least(self, magnitude: torch.Tensor, threshold: float) -> int:
        """How many entries of ``magnitude`` (from :meth:`of`) are >= ``threshold``."""
        return self.at_least(magnitude, threshold).numel()

    def at_least(self, magnitude: torch.Tensor, threshold: float) -> torch.Tensor:
        """Positions i with ``magnitude[i] >= threshold`` (int64, any order; NaN included)."""
        return self._candidates.at_least(magnitude, threshold)
