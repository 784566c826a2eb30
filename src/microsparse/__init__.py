"""microsparse: MiCRO gradient sparsification for data-parallel PyTorch training.

Example:
    >>> import microsparse
    >>> "micro" in microsparse.available_sparsifiers()
    True
"""

import importlib
from typing import Any

from microsparse.errors import ConfigMismatchError, NonFiniteGradientError
from microsparse.options import SparseOptions
from microsparse.ranks import EveryRank, OwnRank
from microsparse.reducer import GradientReducer
from microsparse.sparsifiers import available_sparsifiers, register_sparsifier
from microsparse.stats import StepStats

__version__ = "0.1.0"

_SUBMODULES = ("ddp", "fsdp", "lightning")
"""Imported when first used (``microsparse.ddp.MicroState``): Lightning is an optional extra."""


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"microsparse.{name}")
    raise AttributeError(f"module 'microsparse' has no attribute {name!r}")

__all__ = [
    "ConfigMismatchError", "EveryRank", "GradientReducer", "NonFiniteGradientError", "OwnRank",
    "SparseOptions", "StepStats", "available_sparsifiers", "register_sparsifier", "__version__",
]
