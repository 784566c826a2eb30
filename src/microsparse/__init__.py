"""microsparse: MiCRO gradient sparsification for data-parallel PyTorch training.

Example:
    >>> import microsparse
    >>> "micro" in microsparse.available_sparsifiers()
    True
"""

from microsparse.errors import ConfigMismatchError, NonFiniteGradientError
from microsparse.ranks import EveryRank
from microsparse.reducer import GradientReducer
from microsparse.sparsifiers import available_sparsifiers, register_sparsifier
from microsparse.stats import StepStats

__version__ = "0.1.0"

__all__ = [
    "ConfigMismatchError",
    "EveryRank",
    "GradientReducer",
    "NonFiniteGradientError",
    "StepStats",
    "available_sparsifiers",
    "register_sparsifier",
    "__version__",
]
