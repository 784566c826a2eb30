"""``microsparse bench overhead``: one step's cost against its floor, and against all-reduce."""

from __future__ import annotations

import argparse

from microsparse_lab import arguments
from microsparse_lab.bench import overhead
from microsparse_lab.cli import bench_options

OPTIONS = dict(
    **bench_options.shared("sizes", "partitions", "density"),
    repeats=dict(type=arguments.positive_int, help="timed calls per measurement"),
    loopback_ranks=dict(
        type=arguments.non_negative_int, help="gloo ranks comparing with all-reduce, 0 to skip"
    ),
    variant=dict(
        help="MiCRO with options for the loop, hook and loopback steps and the index exchange, "
        "e.g. 'micro(wire=compact)'"
    ),
)
"""The options of OverheadConfig's fields, in the order ``--help`` lists them."""


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """MiCRO's whole step (loop and hook) in read passes over d, its selection against the
    reference's compare, and synchronize() against a dense all-reduce

    On one thread, in CPU time: the whole per-step overhead of GradientReducer.synchronize() and of
    the DDP hook's step (network taken out) in read passes over d; MiCRO's quota selection and the
    reference's plain compare (at a threshold that selects the same count) in passes over the rank's
    own d/n; then --loopback-ranks gloo ranks on loopback timing synchronize() against a dense
    all-reduce of the same gradient. Writes overhead.json and overhead.md to --out."""
    config = arguments.config_from(overhead.OverheadConfig, args, loopback_repeats=args.repeats)
    return bench_options.run(args, parser, overhead, config)


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    """Add ``microsparse bench overhead``."""
    parser = arguments.command(benchmarks, "overhead", _run)
    arguments.add_fields(parser, overhead.OverheadConfig(), **OPTIONS)
    bench_options.add_common(parser, "overhead", "rewrite the table")
