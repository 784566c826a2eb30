"""Options shared by ``microsparse bench select``, ``bench controller`` and ``simulate``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch

from microsparse_lab import arguments
from microsparse_lab.bench import netns
from microsparse_lab.methods.names import parse_method, split_labels

T = TypeVar("T")


def listing(item: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """An argument type for comma-separated values of type ``item``.

    Example:
        >>> listing(int)("1, 4,16")
        (1, 4, 16)
    """

    def parse(text: str) -> tuple[T, ...]:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return tuple(dict.fromkeys(item(part) for part in parts))

    return parse


positive_ints = listing(arguments.positive_int)
positive_floats = listing(arguments.positive_float)


def names(text: str) -> tuple[str, ...]:
    """Comma-separated sparsifier labels; commas inside ``name(key=value,...)`` stay.

    Example:
        >>> names("topk,micro(selection=threshold,partitioning=contiguous)")
        ('topk', 'micro(selection=threshold,partitioning=contiguous)')
    """
    try:
        return split_labels(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def methods(text: str) -> tuple[str, ...]:
    """Method names of the test bed (:mod:`~microsparse_lab.methods.names`: sparsifiers,
    ``NAME@ddp``, peers), each checked here."""
    labels = names(text)
    for label in labels:
        try:
            parse_method(label)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return labels


def host_count(text: str) -> int:
    """Hosts of the namespace test bed: 2 to 64."""
    value = arguments.positive_int(text)
    if not 2 <= value <= 64:
        raise argparse.ArgumentTypeError(f"host counts must be between 2 and 64, got {value}")
    return value


def link_rate(text: str) -> str:
    """A link rate in tc syntax (``100mbit``, ``1gbit``), checked."""
    try:
        netns.rate_bits(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.strip().lower()


SHARED: dict[str, dict[str, Any]] = {
    "density": dict(type=arguments.density),
    "sizes": dict(type=positive_ints, help="vector lengths d, comma-separated"),
    "partitions": dict(type=positive_ints, help="worker counts n"),
    "rates": dict(type=listing(link_rate), help="link rates, tc syntax"),
    "only": dict(
        flag="--sparsifiers",
        metavar="SPARSIFIERS",
        type=names,
        default=None,
        help="labels, or name(key=value,...) for options, e.g. "
        "'micro,micro(selection=threshold)' (default: all)",
    ),
}
"""The options of config fields that several benchmarks share (for ``add_fields``)."""


def shared(*fields: str) -> dict[str, dict[str, Any]]:
    """The :data:`SHARED` options of ``fields``, to pass on as ``add_fields(**shared(...))``."""
    return {name: SHARED[name] for name in fields}


def add_common(parser: argparse.ArgumentParser, name: str, redo: str) -> None:
    """``--from FILE`` (to ``redo`` from an earlier ``NAME.json`` instead of measuring again:
    :func:`run` reads it), ``--out``, ``--threads``, ``--no-plots``, ``--quiet``."""
    add = parser.add_argument
    add("--from", dest="from_file", metavar="FILE", default=None,
        help=f"{redo} from an earlier {name}.json instead of measuring")  # fmt: skip
    add("--out", default=None, help=f"output directory (default runs/bench/{name}-TIMESTAMP)")
    add(
        "--threads",
        type=arguments.positive_int,
        default=None,
        help=f"torch CPU threads (default: torch's, here {torch.get_num_threads()})",
    )
    add("--no-plots", action="store_true", help="write JSON and Markdown only")
    add("--quiet", action="store_true", help="no progress lines")


def prepare(args: argparse.Namespace, name: str) -> Path:
    """Apply ``--threads``; return the output directory."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return Path(args.out or f"runs/bench/{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def finish(
    write: Callable[..., list[Path]],
    markdown: Callable[[dict[str, Any]], str],
    result: dict[str, Any],
    out: Path,
    args: argparse.Namespace,
) -> int:
    """Write the outputs, print the table and where everything went."""
    try:
        written = write(result, out, plots=not args.no_plots)
    except ModuleNotFoundError as error:  # matplotlib missing
        written = write(result, out, plots=False)
        print(f"note: {error}")
    if not args.quiet:
        print(markdown(result))
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


def on_testbed(
    parser: argparse.ArgumentParser,
    measure: Callable[..., Any],
    config: Any,
    errors: tuple[type[BaseException], ...],
) -> int:
    """Run ``measure(config, log=..., command=...)`` on the namespace test bed: 1 (the error in
    one line) where it fails with one of ``errors``, 128 + the signal where interrupted."""
    command = " ".join(["microsparse", *sys.argv[1:]]) if sys.argv[1:2] == ["bench"] else ""
    try:
        measure(config, log=lambda line: print(line, flush=True), command=command)
    except KeyboardInterrupt as interrupt:
        signum = getattr(interrupt, "signum", 2)
        print(f"{parser.prog}: interrupted; removed every namespace it made", file=sys.stderr)
        return 128 + signum
    except (netns.NetnsError, OSError, *errors) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    return 0


def run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    bench: ModuleType,
    config: Any,
    errors: tuple[type[BaseException], ...] = (ValueError, OSError),
) -> int:
    """Measure ``config`` with the benchmark module ``bench`` (``bench.run``), or load the
    result of ``--from FILE``; write it into ``--out`` (``bench.write``), print its table
    (``bench.markdown``) and where everything went. 2 (the error printed in one line) where
    measuring or loading fails with one of ``errors``."""
    out = prepare(args, bench.__name__.rpartition(".")[2])
    try:
        if args.from_file:
            result = json.loads(Path(args.from_file).read_text())
        else:
            result = bench.run(config, progress=not args.quiet)
    except errors as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    return finish(bench.write, bench.markdown, result, out, args)
