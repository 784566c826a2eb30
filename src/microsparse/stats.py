"""Per-step statistics that every sparsifier reports in the same shape.

A step on a GPU leaves some of its numbers on the device (the threshold it used, how many
entries a shared threshold let through, whether it was skipped): reading one makes the host
wait for the GPU. So :class:`StepStats` holds those as :class:`Pending` values and reads them
only when a field is first asked for; a training loop that never reads them never waits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["StepStats"]


class Pending:
    """A number that a step left on the device, read (once) when first asked for.

    Example:
        >>> threshold = Pending.of(torch.tensor(0.25))
        >>> threshold.get()
        0.25
        >>> Pending.combine(sum, [Pending.of(torch.tensor(2)), 3]).get()
        5
    """

    __slots__ = ("_read", "_value", "_done")

    def __init__(self, read: Callable[[], Any]) -> None:
        self._read = read
        self._value: Any = None
        self._done = False

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Pending:
        """The value of a 0-d (or one-element) tensor, as a Python number."""
        return cls(tensor.item)

    @classmethod
    def combine(cls, how: Callable[[list[Any]], Any], parts: list[Any]) -> Any:
        """``how`` of ``parts`` (numbers or Pending), itself Pending only if a part is."""
        if not any(isinstance(part, Pending) for part in parts):
            return how(parts)
        return cls(lambda: how([resolve(part) for part in parts]))

    def get(self) -> Any:
        if not self._done:
            self._value, self._done = self._read(), True
            self._read = None  # type: ignore[assignment]  # let the device tensors go
        return self._value

    def __repr__(self) -> str:
        return f"Pending({self._value!r})" if self._done else "Pending(on the device)"

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        # Pickled (or deep-copied) as the number itself: a device tensor is not for a file.
        return (_value, (self.get(),))


def _value(value: Any) -> Any:
    return value


def resolve(value: Any) -> Any:
    """``value`` itself, or what a :class:`Pending` holds."""
    return value.get() if isinstance(value, Pending) else value


@dataclass(frozen=True)
class StepStats:
    """What one synchronisation step selected, sent and cost.

    All counts are global (identical on every rank) unless their name starts with ``local_``.

    Example:
        >>> stats = reducer.last_step  # doctest: +SKIP
        >>> stats.selected / stats.target, stats.threshold  # doctest: +SKIP
    """

    step: int
    """Index of this step, counting from 0."""
    numel: int
    """Length d of the flat gradient vector."""
    world_size: int
    """Number of workers n."""
    selected: int
    """K: number of distinct positions whose values were averaged this step."""
    target: int
    """k = max(1, floor(density · d)): the number of positions the user asked for."""
    threshold: float
    """Threshold used for selection this step (NaN for sparsifiers that have none)."""
    local_selected: int
    """Positions this rank selected (its contribution to K)."""
    max_local_selected: int
    """Index slots of each rank's index message, used or not: the padded length (the largest
    rank's selection) or the fixed message's capacity; over a DDP or FSDP pass, summed over
    its slabs' messages; 0 where the step averaged densely (no index message)."""
    partition: tuple[int, int] | None
    """Half-open range [start, end) this rank selected from, for partitioned sparsifiers."""
    bytes_sent: int
    """Bytes this rank sends on the wire, modelled for ring collectives (``microsparse.comm``)."""
    dense_bytes: int
    """Bytes the same rank would send for a dense ring all-reduce of all d values."""
    select_seconds: float
    """Wall time of error-feedback compensation plus selection on this rank (local work only)."""
    exchange_seconds: float
    """Wall time of every collective (including one issued to agree on a threshold, which
    waits for the slowest rank) plus writing the averaged gradient back."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Sparsifier-specific values (e.g. per-rank counts)."""
    proposed: int = 0
    """Σ_r of every rank's proposals before deduplication (K for exclusive, shared and dense)."""
    exchange: str = ""
    """The index framing: ``fixed``, ``compact``, ``padded``, ``union``, ``fixed_union``,
    ``shared`` or ``dense``."""
    skipped: bool = False
    """A NaN or Inf in some rank's gradient (or ranks at different steps) skipped the step:
    every residual is as it was before it, and the average is NaN where it was written."""
    payload_bytes: int = 0
    """Bytes of every message of the step, each rank's counted once whatever the algorithm
    that carries it: all ranks' index messages (headers and padding included), the K values,
    the guard's and any agreement's or plan's; 0 where not known (a peer hook's step). Over
    4 · d it is the share of dense's bytes a ``budget`` asks for (:attr:`budget_used`)."""

    def __getattribute__(self, name: str) -> Any:
        # Fields a step left on the device are read the first time they are asked for.
        value = object.__getattribute__(self, name)
        if isinstance(value, Pending):
            value = value.get()
            object.__setattr__(self, name, value)
        elif name == "extra" and any(isinstance(v, Pending) for v in value.values()):
            value = {key: resolve(v) for key, v in value.items()}
            object.__setattr__(self, name, value)
        return value

    @property
    def density(self) -> float:
        """Actual density K / d."""
        return self.selected / self.numel

    @property
    def target_density(self) -> float:
        """Target density k / d."""
        return self.target / self.numel

    @property
    def ratio_error(self) -> float:
        """Compression ratio error |K/k − 1|."""
        return abs(self.selected / self.target - 1.0)

    @property
    def build_up(self) -> float:
        """Build-up factor K / k: how far the union of all selections exceeds the target.

        Between 1 and n for top-k (1 when all workers pick the same positions); 1 by
        construction for CLT-k, DEFT and dense; for threshold methods it also carries the
        threshold's error. ``proposed / selected`` separates overlap from threshold error.
        """
        return self.selected / self.target

    @property
    def padding_overhead(self) -> float:
        """Index-exchange padding overhead n · max_r k_r / K − 1 (0 when perfectly balanced).

        0 for ``shared`` and ``dense`` exchanges, which all-gather no indices, and for
        ``compact``, whose coded offsets fill no slots (with quotas every rank's count is its
        share, or one short).
        """
        if self.selected == 0 or self.exchange in ("shared", "dense", "compact"):
            return 0.0
        return self.world_size * self.max_local_selected / self.selected - 1.0

    @property
    def traffic_ratio(self) -> float:
        """Bytes sent relative to a dense ring all-reduce (NaN for a single worker)."""
        return self.bytes_sent / self.dense_bytes if self.dense_bytes else math.nan

    @property
    def budget_used(self) -> float:
        """Payload bytes relative to dense's 4 bytes (float32) per entry, ``payload_bytes /
        (4 · d)``: what ``SparseOptions(budget=...)`` aims at."""
        return self.payload_bytes / (4 * self.numel)

    def as_record(self) -> dict[str, Any]:
        """A flat, JSON-serialisable dict including the derived quantities."""
        record = asdict(self)
        record.pop("extra")
        record.update(self.extra)
        record["partition"] = list(self.partition) if self.partition else None
        derived = ("density", "target_density", "ratio_error", "build_up", "padding_overhead")
        for name in (*derived, "traffic_ratio", "budget_used"):
            record[name] = getattr(self, name)
        return record
