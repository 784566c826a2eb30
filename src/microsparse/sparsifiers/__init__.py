"""What is selected: the registry of sparsifiers, by name.

Example:
    >>> from microsparse.sparsifiers import available_sparsifiers
    >>> "micro" in available_sparsifiers()
    True

The choices of MiCRO's options (``SELECTIONS``, ``INDEX_MESSAGES``, ``WIRES``,
``PARTITIONINGS``, ``THRESHOLD_RULES``) and top-k's (``TOPK_WIRES``) are exported for command
lines that offer them;
``initial_threshold`` is exported for benchmarks that time a selection from MiCRO's first step.
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
from microsparse.sparsifiers.micro import INDEX_MESSAGES, SELECTIONS, WIRES
from microsparse.sparsifiers.partition import PARTITIONINGS
from microsparse.sparsifiers.registry import (
    available_sparsifiers,
    create_sparsifier,
    keywords_of,
    method_sparsifiers,
    register_sparsifier,
)
from microsparse.sparsifiers.threshold import THRESHOLD_RULES, initial_threshold
from microsparse.sparsifiers.topk import TOPK_WIRES

__all__ = [
    "INDEX_MESSAGES", "PARTITIONINGS", "SELECTIONS", "THRESHOLD_RULES", "TOPK_WIRES", "WIRES",
    "Sparsifier",
    "available_sparsifiers", "create_sparsifier", "initial_threshold", "keywords_of",
    "method_sparsifiers", "register_sparsifier", "validate_density",
]
