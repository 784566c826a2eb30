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

Exchange = Literal["exclusive", "union", "dense"]
"""How per-rank selections combine: ``exclusive`` (disjoint by construction, concatenated),
``union`` (may overlap, deduplicated) or ``dense`` (no selection; plain all-reduce)."""


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
    """

    name: ClassVar[str]
    exchange: ClassVar[Exchange]

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
        """Flat positions (int64, ascending) this rank proposes to send at ``step``."""

    def update(self, selected: int) -> None:
        """Observe the global selected count K of the step that just ended."""

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
