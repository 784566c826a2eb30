"""What is selected: the registry of sparsifiers, by name.

Example:
    >>> from microsparse.sparsifiers import available_sparsifiers
    >>> "micro" in available_sparsifiers()
    True
"""

from microsparse.sparsifiers import (  # noqa: F401  (importing a module registers it)
    cltk,
    deft,
    dense,
    hard_threshold,
    micro,
    oracle,
    sage,
    topk,
)
from microsparse.sparsifiers.base import Sparsifier, validate_density
from microsparse.sparsifiers.registry import (
    available_sparsifiers,
    create_sparsifier,
    keywords_of,
    method_sparsifiers,
    register_sparsifier,
)

__all__ = [
    "Sparsifier",
    "available_sparsifiers",
    "create_sparsifier",
    "keywords_of",
    "method_sparsifiers",
    "register_sparsifier",
    "validate_density",
]
