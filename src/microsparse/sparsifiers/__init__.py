"""What is selected: the registry of sparsifiers, by name.

Example:
    >>> from microsparse.sparsifiers import available_sparsifiers
    >>> "micro" in available_sparsifiers()
    True
"""

from __future__ import annotations

from typing import Any, TypeVar

from microsparse.sparsifiers.base import Sparsifier, validate_density

_REGISTRY: dict[str, type[Sparsifier]] = {}
S = TypeVar("S", bound=type[Sparsifier])


def register_sparsifier(cls: S) -> S:
    """Class decorator that makes a sparsifier available under ``cls.name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"a sparsifier named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def available_sparsifiers() -> list[str]:
    """Names accepted by ``sparsifier=`` and ``--sparsifier``."""
    return sorted(_REGISTRY)


def method_sparsifiers() -> list[str]:
    """The names of :func:`available_sparsifiers` that are methods to train with, the ones the
    benchmarks time by default: all but yardsticks such as ``oracle``.

    Example:
        >>> "oracle" in available_sparsifiers(), "oracle" in method_sparsifiers()
        (True, False)
    """
    return [name for name in available_sparsifiers() if not _REGISTRY[name].yardstick]


def create_sparsifier(name: str, density: float, **options: Any) -> Sparsifier:
    """Instantiate a registered sparsifier, with errors that name the bad argument."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(
            f"sparsifier must be one of {', '.join(available_sparsifiers())}; got {name!r}"
        )
    cls = _REGISTRY[name]
    accepted = cls.option_names()
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        hint = f"it accepts: {', '.join(accepted)}" if accepted else "it takes no options"
        raise ValueError(
            f"sparsifier {name!r} has no option {', '.join(map(repr, unknown))}; {hint}"
        )
    return cls(density, **options)


# Importing the modules registers their sparsifiers.
from microsparse.sparsifiers import (  # noqa: E402,F401
    cltk,
    deft,
    dense,
    hard_threshold,
    micro,
    oracle,
    sage,
    topk,
)

__all__ = [
    "Sparsifier",
    "available_sparsifiers",
    "create_sparsifier",
    "method_sparsifiers",
    "register_sparsifier",
    "validate_density",
]
