"""The contract between the reducer and a sparsifier: *what* is selected.

A sparsifier only decides which positions of the error-feedback-accumulated flat vector this
rank proposes for sending, and how those proposals combine across ranks (``exchange``). The
reducer does everything else: accumulation and residuals (``microsparse.feedback``), the
collectives (``microsparse.comm``), and writing the averaged gradient back.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

import torch

from microsparse.layout import Layout

Exchange = Literal["exclusive", "fixed", "union", "shared", "dense"]
"""How per-rank selections combine: ``exclusive`` (disjoint by construction, concatenated),
``fixed`` (exclusive, in one fixed-capacity message per rank that also carries the count and
the step's checks: the sparsifier sets ``capacity``), ``union`` (may overlap, deduplicated),
``shared`` (every rank selects the same positions, e.g. from a leader's plan: no index
exchange) or ``dense`` (no selection; plain all-reduce)."""


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
    """Base class of every sparsifier in the registry.

    Subclasses set ``name`` and ``exchange``, implement ``select`` and, if they adapt over
    time, ``update`` and the ``state_dict`` pair. Constructor keyword arguments are the
    user-facing options (``GradientReducer(..., sparsifier="micro", threshold_rule="as_coded")``).

    Sparsifiers whose selection a leader decides set ``planned = True`` and implement the plan
    trio. Each step the reducer then calls ``make_plan`` on the leader only, broadcasts that
    fixed-size tensor (``empty_plan`` gives every rank its shape), and calls ``adopt_plan`` on
    every rank before ``select``; ``adopt_plan`` returns what every rank will select, so no
    count has to be exchanged.
    """

    name: ClassVar[str]
    exchange: Exchange
    planned: ClassVar[bool] = False
    capacity: int = 0
    """Per-rank slots of the index message, for the ``fixed`` exchange. The same at every step:
    a rank whose step counter disagrees must still meet the others in an equal-sized
    all-gather, so that the header can report the disagreement instead of gloo aborting."""

    def __init__(self, density: float) -> None:
        self.density = validate_density(density)

    def bind(self, layout: Layout, rank: int, world_size: int) -> None:
        """Called once by the reducer before the first step."""
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.target = max(1, math.floor(self.density * layout.numel))

    @abstractmethod
    def select(self, accumulated: torch.Tensor, step: int) -> torch.Tensor:
        """Distinct flat positions (int64, any order) this rank proposes to send at ``step``."""

    def update(self, selected: int) -> None:
        """Observe the global selected count K of the step that just ended."""

    def agreement(self, accumulated: torch.Tensor, step: int) -> torch.Tensor | None:
        """A small vector to sum over all ranks before ``select`` (e.g. a histogram), or None.

        The reducer all-reduces it and hands the sum to :meth:`adopt_agreement`, so that every
        rank can derive the same parameters of this step's selection from everyone's data.
        """
        return None

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

    def report(self) -> dict[str, Any]:
        """Sparsifier-specific values of the step just selected, for ``StepStats.extra``."""
        return {}

    @property
    def threshold(self) -> float:
        """The selection threshold of the next step, NaN if the sparsifier has none."""
        return math.nan

    def partition(self, step: int) -> tuple[int, int] | None:
        """The range this rank selects from at ``step``, if the sparsifier partitions."""
        return None

    def options(self) -> dict[str, Any]:
        """User-facing options, for checking that all ranks agree and for reports."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Magnitudes:
    """|a| over a whole vector in preallocated buffers, for whole-vector selection.

    Allocating d floats every step costs page faults comparable to the selection itself,
    so the magnitude and mask buffers are made once and reused.

    Example:
        >>> buffers = Magnitudes()
        >>> magnitude = buffers.of(torch.tensor([0.5, -2.0, 0.1, 3.0]))
        >>> buffers.at_least(magnitude, 1.0).tolist(), int(buffers.count_at_least(magnitude, 0.2))
        ([1, 3], 3)
    """

    def __init__(self) -> None:
        self._magnitude: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    def of(self, values: torch.Tensor) -> torch.Tensor:
        """|values|, written into the reused buffer (valid until the next call)."""
        if self._magnitude is None or self._magnitude.shape != values.shape:
            self._magnitude = torch.empty_like(values)
            self._mask = torch.empty(values.shape, dtype=torch.bool, device=values.device)
        return torch.abs(values, out=self._magnitude)

    def _compare(self, magnitude: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
        assert self._mask is not None, "call of() first"
        return torch.ge(magnitude, threshold, out=self._mask)

    def count_at_least(
        self, magnitude: torch.Tensor, threshold: float | torch.Tensor
    ) -> torch.Tensor:
        """How many entries of ``magnitude`` (from :meth:`of`) are >= ``threshold`` (0-d)."""
        return self._compare(magnitude, threshold).sum()

    def at_least(self, magnitude: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
        """Positions i with ``magnitude[i] >= threshold`` (int64, ascending)."""
        return torch.nonzero(self._compare(magnitude, threshold)).squeeze(1)
