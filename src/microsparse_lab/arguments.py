"""The commands' arguments: types that reject bad input with a message naming the fix, options
built from config dataclasses, and the commands themselves."""

from __future__ import annotations

import argparse
import inspect
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, field, fields
from typing import Any, TypeVar

from microsparse.options import validate_budget
from microsparse.sparsifiers import validate_density

T = TypeVar("T")


def whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number >= {minimum}, got {text!r}"
        ) from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return whole_number(text, 1)


def non_negative_int(text: str) -> int:
    return whole_number(text, 0)


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def density(text: str) -> float:
    try:
        return validate_density(number(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def budget(text: str) -> float:
    """A byte budget: a fraction of dense's bytes, > 0 (``microsparse.SparseOptions``)."""
    try:
        return validate_budget(number(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_float(text: str) -> float:
    value = number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def momentum(text: str) -> float:
    value = number(text)
    if not 0 <= value < 1:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text!r}")
    return value


def density_warmup(text: str) -> tuple[float, float]:
    """``START,EPOCHS``: a start density and the epochs it takes to decay to --density."""
    start, comma, epochs = text.partition(",")
    if not comma:
        raise argparse.ArgumentTypeError(f"expected START,EPOCHS (e.g. 0.01,0.5), got {text!r}")
    return density(start), positive_float(epochs)


def non_negative_float(text: str) -> float:
    value = number(text)
    if not (value >= 0 and value != float("inf")):  # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def assignment(text: str) -> tuple[str, Any]:
    """``NAME=VALUE``, the value parsed as JSON where it can be (numbers, lists, true/false)."""
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def whole_numbers(text: str) -> tuple[int, ...]:
    """Comma-separated whole numbers >= 0 (e.g. epochs)."""
    return tuple(non_negative_int(part) for part in text.split(",") if part.strip())


def steps_or_epoch(text: str) -> int | str:
    return "epoch" if text == "epoch" else positive_int(text)


def option(value: Any = None, /, *, factory: Any = MISSING, **how: Any) -> Any:
    """A dataclass field that says how the command line sets it, for :func:`add_fields`.

    ``value`` is the field's default (or ``factory()``'s); ``how`` holds ``add_argument``'s
    keywords (help, type, choices, action, metavar, ..., and a ``default`` of the option's
    own), and ``flag`` where the option is not ``--field-name``; a callable ``help`` or
    ``choices`` is called when the parser is built (what is registered by then)."""
    if factory is not MISSING:
        return field(default_factory=factory, metadata={_OPTION: how})
    return field(default=value, metadata={_OPTION: how})


def add_fields(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    config: Any,
    *names: str,
    quick: Mapping[str, Any] | None = None,
    prefix: str = "",
    **options: Mapping[str, Any],
) -> None:
    """Add one option per field of the dataclass ``config``, each declared once.

    ``names`` are fields that declare their option themselves (:func:`option`); each keyword
    of ``options`` is a field and ``add_argument``'s keywords for it (``flag`` for another
    name than ``--field-name``); a ``prefix`` goes before every name (``--predict-numel``). The
    parsed value is ``args.PREFIX_NAME`` unless a ``dest`` says.

    The default is the field's value in ``config`` (an instance), and the help ends naming it
    (and ``quick``'s value, where that holds the field) unless it speaks of its default
    itself; a field in ``quick`` defaults to ``None``, and :func:`config_from` fills it in.
    ``config`` a class leaves every default ``None``, so that what was given tells itself
    apart, and ``%(default)s`` in the help shows the class's default. With ``quick``, a
    ``--quick`` option follows that says what it sets.

    Example:
        >>> from dataclasses import dataclass
        >>> parser = argparse.ArgumentParser()
        >>> @dataclass
        ... class Run:
        ...     steps: int = option(10, type=positive_int, help="(default: %(default)s)")
        >>> add_fields(parser, Run, "steps")
        >>> parser.parse_args(["--steps", "3"]).steps, parser.parse_args([]).steps
        (3, None)
    """
    declared = {f.name: f for f in fields(config)}
    specs = {name: declared[name].metadata[_OPTION] for name in names}
    for name, how in {**specs, **options}.items():
        how = {key: value() if key in ("help", "choices") and callable(value) else value
               for key, value in how.items()}  # fmt: skip
        if isinstance(config, type):
            shown = str(_default(declared[name]))
            how["help"] = how.get("help", "").replace("%(default)s", shown) or None
            how.setdefault("default", None)
        elif "default" not in how:
            value = getattr(config, name)
            how["default"] = None if quick and name in quick else value
            how["help"] = _with_default(how.get("help"), value, (quick or {}).get(name))
        how.setdefault("dest", prefix + name)
        parser.add_argument(how.pop("flag", "--" + (prefix + name).replace("_", "-")), **how)
    if quick:
        given = ", ".join(
            f"--{name.replace('_', '-')} {_show(value)}" for name, value in quick.items()
        )
        parser.add_argument("--quick", action="store_true", help=f"a small run: {given}")


def flag(config_class: type, name: str) -> str:
    """The option that sets field ``name`` of ``config_class`` (:func:`option`)."""
    declared = config_class.__dataclass_fields__.get(name)
    how = declared.metadata.get(_OPTION, {}) if declared else {}
    return how.get("flag", "--" + name.replace("_", "-"))


def config_from(
    config_class: type[T],
    args: argparse.Namespace,
    quick: Mapping[str, Any] | None = None,
    **values: Any,
) -> T:
    """``config_class`` with the fields given in ``args`` (``None``: not given), else in
    ``quick`` when ``args.quick`` is set, else its defaults; ``values`` set fields that ``args``
    holds under other names."""
    preset = quick if quick and getattr(args, "quick", False) else {}
    given = {}
    for f in fields(config_class):
        value = getattr(args, f.name, None)
        value = preset.get(f.name) if value is None else value
        if value is not None:
            given[f.name] = value
    return config_class(**{**given, **values})


_OPTION = "microsparse_lab.option"


def _default(declared: Field) -> Any:
    if declared.default_factory is not MISSING:
        return declared.default_factory()
    return declared.default


def _with_default(help: str | None, value: Any, quick: Any) -> str | None:
    """``help`` naming the default (and --quick's value), unless it speaks of it itself."""
    if help is not None and "(default" in help or value is None:
        return help
    note = f"(default: {_show(value)}" + ("" if quick is None else f"; quick: {_show(quick)}") + ")"
    return f"{help} {note}" if help else note


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return f"{value:,}" if isinstance(value, int) else str(value)


def command(
    commands: argparse._SubParsersAction, name: str, run: Callable[..., int], **values: str
) -> argparse.ArgumentParser:
    """Add the command ``name``, whose parsed arguments run ``run(args, parser)``.

    The command documents itself once, in ``run``'s docstring: its first paragraph is the
    help in the list of commands, the rest the description of ``name --help`` (its ``{name}``s
    filled in from ``values``)."""
    summary, _, body = (inspect.getdoc(run) or "").partition("\n\n")
    description = body.format(**values) if values else body
    parser = commands.add_parser(name, help=" ".join(summary.split()), description=description)
    parser.set_defaults(run=run, parser=parser)
    return parser
