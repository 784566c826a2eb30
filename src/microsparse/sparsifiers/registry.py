"""The registry of sparsifiers by name, and their construction with errors that name the fix."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from microsparse.sparsifiers.base import Sparsifier

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


def create_sparsifier(
    name: str, density: float, *, owner: tuple[str, Sequence[str]] | None = None, **options: Any
) -> Sparsifier:
    """Instantiate a registered sparsifier, with errors that name the bad argument.

    ``owner``: the caller's name and its own keywords, for a keyword that neither it nor the
    sparsifier takes (the error then suggests the closest spelling among all of them).

    Example:
        >>> create_sparsifier("topk", 0.1, owner=("GradientReducer", ["value_dtype"]),
        ...                   value_dtyp=None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: GradientReducer got an unexpected keyword 'value_dtyp' (did you mean ...
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(
            f"sparsifier must be one of {', '.join(available_sparsifiers())}; got {name!r}"
        )
    cls = _REGISTRY[name]
    accepted = cls.option_names()
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise _unknown_option(name, unknown[0], accepted, owner)
    return cls(density, **options)


def keywords_of(cls: type | Callable[..., Any]) -> tuple[str, list[str]]:
    """A class's name and its constructor's keyword-only parameters (or a function's): the
    ``owner`` of :func:`create_sparsifier` for a caller that passes the rest of its keywords on.

    Example:
        >>> class Reducer:
        ...     def __init__(self, density, *, value_dtype=None, **options): ...
        >>> keywords_of(Reducer)
        ('Reducer', ['value_dtype'])
    """
    names = inspect.signature(cls.__init__ if isinstance(cls, type) else cls).parameters
    return cls.__name__, [name for name, p in names.items() if p.kind == p.KEYWORD_ONLY]


def _unknown_option(
    name: str, bad: str, accepted: list[str], owner: tuple[str, Sequence[str]] | None
) -> Exception:
    hint = f"takes: {', '.join(accepted)}" if accepted else "takes no options"
    if bad == "transactional":
        return TypeError(
            "transactional is gone: a failed step now always leaves every residual as it "
            "was; pass nonfinite='raise' to raise NonFiniteGradientError instead of skipping"
        )
    if bad == "wire":
        return TypeError(
            f"sparsifier {name!r} has no option 'wire': the compact wire sends each position as "
            "an offset into a range its rank owns, which only micro's partitions give; use "
            "'micro' with wire='compact', or leave wire out"
        )
    if owner is None:
        return ValueError(f"sparsifier {name!r} has no option {bad!r}; it {hint}")
    caller, keywords = owner
    close = difflib.get_close_matches(bad, [*keywords, *accepted], n=1)
    suggestion = f" (did you mean {close[0]!r}?)" if close else ""
    return TypeError(
        f"{caller} got an unexpected keyword {bad!r}{suggestion}. {caller} takes "
        f"{', '.join(keywords)}; sparsifier {name!r} {hint}"
    )
