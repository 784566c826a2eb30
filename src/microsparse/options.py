"""The options of sparse averaging, checked in one place for every integration.

The loop API (:class:`~microsparse.GradientReducer`), the DDP hook
(:class:`~microsparse.ddp.SparseState`) and FSDP2 (:func:`microsparse.fsdp.sparsify`) take
the same keywords. Each builds a :class:`SparseOptions` from them, which checks them together
and names the option and the fix on an error. A run configured in one place builds one and
hands it to whichever integration it uses::

    options = microsparse.SparseOptions("micro", 0.001, value_dtype=torch.bfloat16)
    reducer = microsparse.GradientReducer(model.parameters(), **options.kwargs())
    state = microsparse.ddp.SparseState(**options.kwargs())

What to send is asked for in one of two ways: ``density``, the fraction of the gradient's
entries, or ``budget``, the fraction of dense averaging's bytes (4 per entry, float32). A
budget becomes the density whose entries cost that many bytes on the chosen wire
(:meth:`~microsparse.sparsifiers.Sparsifier.density_for`): density · bytes per entry =
budget · 4, e.g. budget 0.002 is density 0.001 on the plain wire (an int32 index and a float32
value). On MiCRO's compact wire an offset costs fewer bits the more are sent (Elias–Fano,
about 2 + log2(1 / density)), so the two are solved together. Given neither, a run spends
:data:`DEFAULT_BUDGET` (0.2 % of dense's bytes): MiCRO sends 0.35 % of the entries on its
compact wire with 8-bit values (2.26 bytes an entry, up to
:data:`~microsparse.sparsifiers.micro.INT8_RANKS` = 16 ranks), 0.24 % with bfloat16 values
beyond, the baselines 0.1 % on the plain wire. What an entry costs can depend on the number
of ranks, so each integration prices a budget again for its own (:meth:`SparseOptions.for_ranks`).

At density 1 every sparsifier averages densely (one all-reduce, as DDP does), so the options
that need a residual (momentum and Adam correction, a density warm-up) are refused there.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field, fields, replace
from typing import Any, ClassVar

import torch

from microsparse.engine.step import NONFINITE, NonFinite
from microsparse.feedback import check_adam, check_momentum
from microsparse.sparsifiers import Sparsifier, create_sparsifier
from microsparse.sparsifiers.base import validate_density
from microsparse.sparsifiers.warmup import DensityWarmup

__all__ = ["DEFAULT_BUDGET", "DENSE_ENTRY_BYTES", "SparseOptions", "validate_budget"]

VALUE_DTYPES = (None, torch.float16, torch.bfloat16, torch.int8)
DEFAULT_BUDGET = 0.002
"""The fraction of dense averaging's bytes sent where neither density nor budget is given:
density 0.001 at 8 bytes an entry (the plain wire), 0.00267 at 3 (MiCRO's compact wire with
8-bit values, up to 16 ranks), 0.002 at 4 (with bfloat16 values, beyond)."""
DENSE_ENTRY_BYTES = 4
"""Bytes dense averaging sends per gradient entry (float32): what a budget is a fraction of."""


def validate_budget(budget: float) -> float:
    """Return ``budget`` as a float, or raise naming the argument and what it means."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(
            f"budget must be a number > 0, a fraction of dense's bytes (e.g. 0.002), got {budget!r}"
        )
    budget = float(budget)
    if not math.isfinite(budget) or budget <= 0.0:
        raise ValueError(
            f"budget must be > 0, a fraction of dense's bytes (e.g. 0.002 sends 0.2 % of them), "
            f"got {budget!r}"
        )
    return budget


@dataclass(frozen=True)
class SparseOptions:
    """What to send and how: the sparsifier, its density and options, and the corrections.

    Built from the keywords every integration takes, checked on construction (normalised:
    numbers as floats, ``density_warmup`` as a ``DensityWarmup``). Give ``density`` or
    ``budget``, not both: ``density`` then holds the density the budget resolved to, and
    ``budget`` stays as given (None where a density was).
    ``owner`` names the caller and its own keywords, so that a misspelt keyword is reported
    with the closest spelling among everything the caller takes.

    Example:
        >>> options = SparseOptions("micro", 0.001, momentum_correction=0.9)
        >>> options.kwargs()["momentum_correction"], options.averages_densely
        (0.9, False)
        >>> SparseOptions.from_dict(options.to_dict()) == options
        True
        >>> round(SparseOptions("micro", budget=0.002).density, 6)  # compact, int8: 2.26 bytes
        0.003535
        >>> round(SparseOptions("micro", budget=0.002).for_ranks(64).density, 6)  # bfloat16
        0.002404
        >>> SparseOptions("micro", budget=0.002, options={"wire": "plain"}).density  # int32 + fp32
        0.001
        >>> SparseOptions("topk").density   # DEFAULT_BUDGET on the plain wire
        0.001
        >>> SparseOptions("micro", 1.0, momentum_correction=0.9)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: momentum_correction needs error feedback, but this state averages densely ...
    """

    sparsifier: str = "micro"
    density: float | None = None
    """The fraction of entries to send (where neither it nor ``budget`` is given, the density
    :data:`DEFAULT_BUDGET` buys)."""
    value_dtype: torch.dtype | None = None
    nonfinite: NonFinite = "skip"
    momentum_correction: float = 0.0
    momentum_nesterov: bool = False
    adam_correction: tuple[float, float, float] | None = None
    density_warmup: DensityWarmup | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    """The sparsifier's own options (e.g. MiCRO's ``selection``)."""
    budget: float | None = None
    """The fraction of dense averaging's bytes to send, instead of ``density``."""
    owner: InitVar[tuple[str, list[str]] | None] = None
    ranks: InitVar[int | None] = None
    """The number of ranks that average, where known: what an entry costs, and so the
    density a budget buys, can depend on it (:meth:`for_ranks`)."""

    DTYPES: ClassVar[dict[str, torch.dtype | None]] = {
        str(dtype): dtype for dtype in VALUE_DTYPES
    }
    VALUE_DTYPE_NAMES: ClassVar[tuple[str, ...]] = tuple(
        str(dtype).removeprefix("torch.") for dtype in VALUE_DTYPES if dtype is not None
    )
    """The value dtypes by short name, as a command line gives them (``--value-dtype int8``)."""

    @classmethod
    def value_dtype_named(cls, name: str) -> torch.dtype:
        """The value dtype a short name means.

        Example:
            >>> SparseOptions.value_dtype_named("int8")
            torch.int8
        """
        if name not in cls.VALUE_DTYPE_NAMES:
            raise ValueError(f"value_dtype must be one of {', '.join(cls.VALUE_DTYPE_NAMES)}; "
                             f"got {name!r}")  # fmt: skip
        return getattr(torch, name)

    def __post_init__(self, owner: tuple[str, list[str]] | None, ranks: int | None) -> None:
        if self.value_dtype not in VALUE_DTYPES:
            raise ValueError(
                "value_dtype must be None, torch.float16, torch.bfloat16 or torch.int8; "
                f"got {self.value_dtype!r}"
            )
        if self.nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be 'skip' or 'raise'; got {self.nonfinite!r}")
        # What for_ranks() needs: whether the density was bought, and for how many ranks.
        object.__setattr__(self, "_bought", self.density is None or self.budget is not None)
        object.__setattr__(self, "_ranks", ranks)
        density, sparsifier = self._resolved_density(owner, ranks)
        if self.value_dtype == torch.int8:
            _check_int8_wire(sparsifier, self.sparsifier)
        momentum = check_momentum(self.momentum_correction)
        adam = None if self.adam_correction is None else check_adam(self.adam_correction)
        warmup = DensityWarmup.of(self.density_warmup)
        self._set(density=density, budget=None if self.budget is None else float(self.budget),
                  momentum_correction=momentum, adam_correction=adam,
                  momentum_nesterov=bool(self.momentum_nesterov), density_warmup=warmup,
                  options=dict(self.options))  # fmt: skip
        self._check_corrections()

    def _resolved_density(
        self, owner: tuple[str, list[str]] | None, ranks: int | None
    ) -> tuple[float, Sparsifier]:
        """``density``, or the density ``budget`` buys on the sparsifier's wire, and a
        sparsifier of these options; the sparsifier's errors first, with the closest spelling
        of a misspelt keyword."""
        if self.density is not None and self.budget is None:
            density = validate_density(self.density)
            return density, create_sparsifier(self.sparsifier, density, owner=owner,
                                              **self.options)  # fmt: skip
        if self.density is not None:
            raise ValueError(
                f"give density or budget, not both (got density={self.density!r}, "
                f"budget={self.budget!r}): a budget sets the density from the bytes an entry "
                "costs on the wire; leave density out"
            )
        budget = DEFAULT_BUDGET if self.budget is None else validate_budget(self.budget)
        probe = create_sparsifier(self.sparsifier, 1.0, owner=owner, **self.options)
        density = probe.density_for(budget, self.value_dtype, ranks)
        if density > 1.0:
            entry = probe.entry_bytes(self.value_dtype, ranks)  # the probe's density is 1
            largest = entry / DENSE_ENTRY_BYTES
            raise ValueError(
                f"budget={budget!r} buys more than every entry: {self.sparsifier} sends "
                f"{entry:g} bytes an entry on this wire at density 1 (value_dtype="
                f"{self.value_dtype}), so its budget is at most {largest:g}; give a budget up "
                f"to {largest:g}, or density=1 to average densely"
            )
        return density, probe

    def _set(self, **values: Any) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def _check_corrections(self) -> None:
        densely = self.averages_densely
        if self.adam_correction is not None and self.momentum_correction:
            raise ValueError(
                "adam_correction keeps Adam's moments of unscaled gradients and replaces "
                "momentum correction: use it without momentum_correction"
            )
        if self.adam_correction is not None and densely:
            raise ValueError(
                "adam_correction needs error feedback, but this state averages densely "
                "(dense, or density 1): leave adam_correction unset and keep the optimiser's Adam"
            )
        if self.momentum_correction and densely:
            raise ValueError(
                "momentum_correction needs error feedback, but this state averages densely "
                "(dense, or density 1): leave momentum_correction at 0 and keep the optimiser's "
                "momentum"
            )
        if self.density_warmup is not None:
            if densely:
                raise ValueError(
                    "density_warmup needs a sparsifier that selects, but this state averages "
                    "densely (dense, or density 1): leave density_warmup unset"
                )
            self.density_warmup.check(self.density)

    def check_scaler(self, grad_scaler: Any) -> None:
        """Refuse a ``GradScaler`` beside Adam correction (its moments are of unscaled
        gradients)."""
        if grad_scaler is not None and self.adam_correction is not None:
            raise ValueError(
                "adam_correction keeps Adam's moments of unscaled gradients: it cannot follow "
                "a grad_scaler's scale; train without the scaler (bf16 autocast needs none)"
            )

    @property
    def averages_densely(self) -> bool:
        """Density 1, or the ``dense`` sparsifier: plain averaging, one all-reduce."""
        return self.density >= 1.0 or self.sparsifier == "dense"

    @property
    def momentum(self) -> tuple[float, bool]:
        """Momentum correction as (m, Nesterov); m = 0: off."""
        return self.momentum_correction, self.momentum_nesterov

    def for_ranks(self, world_size: int) -> SparseOptions:
        """These options as they run on ``world_size`` ranks: a density bought with a budget
        is bought again at what an entry costs there (MiCRO's compact wire sends 8-bit
        values up to 16 ranks, bfloat16 beyond); a density given stays.

        Example:
            >>> options = SparseOptions("micro")               # DEFAULT_BUDGET
            >>> options.for_ranks(8) is options, round(options.for_ranks(32).density, 6)
            (True, 0.002404)
        """
        if not self._bought or self.averages_densely:
            return self
        probe, dtype = create_sparsifier(self.sparsifier, 1.0, **self.options), self.value_dtype
        if probe.entry_bytes(dtype, world_size) == probe.entry_bytes(dtype, self._ranks):
            return self
        return replace(self, density=None, ranks=world_size)

    def wire_value_dtype(self, world_size: int | None = None) -> torch.dtype | None:
        """The dtype the values travel in on ``world_size`` ranks (None: not known yet):
        ``value_dtype``, else the wire's choice; None where that is the gradient's own.

        Example:
            >>> [SparseOptions(name).wire_value_dtype(4) for name in ("micro", "topk")]
            [torch.int8, None]
        """
        if self.value_dtype is not None or self.averages_densely:
            return self.value_dtype
        return create_sparsifier(self.sparsifier, 1.0, **self.options).wire_values(world_size)

    def make_sparsifier(self) -> Sparsifier:
        """A fresh, unbound sparsifier (``dense`` where these options average densely)."""
        if self.averages_densely:
            return create_sparsifier("dense", 1.0)
        return create_sparsifier(self.sparsifier, self.density, **self.options)

    def kwargs(self) -> dict[str, Any]:
        """The keywords that build these options in any integration."""
        asked = "density" if self.budget is not None else "budget"  # the other one was given
        named = {f.name: getattr(self, f.name) for f in fields(self)
                 if f.name not in ("options", asked)}  # fmt: skip
        return {**named, **self.options}

    def corrections(self) -> dict[str, Any]:
        """The corrections that are on, by name (absent when off, so older states load)."""
        described: dict[str, Any] = {}
        if self.momentum_correction:
            described["momentum_correction"] = list(self.momentum)
        if self.adam_correction is not None:
            described["adam_correction"] = list(self.adam_correction)
        if self.density_warmup is not None:
            warmup = self.density_warmup
            described["density_warmup"] = [warmup.start, warmup.steps]
        return described

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (JSON, checkpoints); :meth:`from_dict` reads it back."""
        return {
            "sparsifier": self.sparsifier,
            "density": self.density,
            "value_dtype": str(self.value_dtype),
            "nonfinite": self.nonfinite,
            **({} if self.budget is None else {"budget": self.budget}),
            **self.corrections(),
            **self.options,
        }

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SparseOptions:
        values = dict(values)
        dtype = cls.DTYPES[values.pop("value_dtype", "None")]
        momentum, nesterov = values.pop("momentum_correction", (0.0, False))
        warmup = values.pop("density_warmup", None)
        adam = values.pop("adam_correction", None)
        if "budget" in values:  # the density is the budget's, resolved again
            values.pop("density", None)
        named = {name: values.pop(name)
                 for name in ("sparsifier", "density", "budget", "nonfinite")
                 if name in values}  # fmt: skip
        return cls(**named, value_dtype=dtype, momentum_correction=momentum,
                   momentum_nesterov=nesterov, adam_correction=adam, options=values,
                   density_warmup=None if warmup is None else tuple(warmup))  # fmt: skip

    def fingerprint(self) -> int:
        """A checksum of every option, equal on ranks whose options are equal."""
        return zlib.crc32(repr(sorted(self.to_dict().items())).encode())


def _check_int8_wire(sparsifier: Sparsifier, name: str) -> None:
    """Refuse int8 values on a wire without room for their scale, where the options tell the
    wire; a sparsifier that states no framing class is checked by the engine once bound."""
    try:
        kind = sparsifier.framing_kind()
    except TypeError:
        return
    kind.check_value_dtype(torch.int8, name)
