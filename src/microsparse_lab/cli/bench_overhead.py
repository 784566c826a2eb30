"""``microsparse bench overhead``: one step's cost against its floor, and against all-reduce."""

from __future__ import annotations

import argparse

from microsparse_lab import arguments
from microsparse_lab.bench import overhead
from microsparse_lab.cli import bench_options


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    """Add ``microsparse bench overhead``."""
    full = overhead.OverheadConfig()
    parser = benchmarks.add_parser(
        "overhead",
        help="MiCRO's whole step (loop and hook) in read passes over d, its selection against "
        "the reference's compare, and synchronize() against a dense all-reduce",
        description="On one thread, in CPU time: the whole per-step overhead of "
        "GradientReducer.synchronize() and of the DDP hook's step (network taken out) in read "
        "passes over d; MiCRO's quota selection and the reference's plain compare (at a "
        "threshold that selects the same count) in passes over the rank's own d/n; then "
        "--loopback-ranks gloo ranks on loopback timing synchronize() against a dense "
        "all-reduce of the same gradient. Writes overhead.json and overhead.md to --out.",
    )
    add = parser.add_argument
    add("--sizes", type=bench_options.positive_ints, default=full.sizes,
        help="vector lengths d (default: %(default)s)")  # fmt: skip
    add("--partitions", type=bench_options.positive_ints, default=full.partitions,
        help="worker counts n (default: %(default)s)")  # fmt: skip
    add("--density", type=arguments.density, default=full.density, help="(default: %(default)s)")
    add("--repeats", type=arguments.positive_int, default=full.repeats,
        help="timed calls per measurement (default: %(default)s)")  # fmt: skip
    add("--variant", default=full.variant,
        help="MiCRO with options for the loop, hook and loopback steps, e.g. "
        "'micro(wire=compact)' (default: %(default)s)")  # fmt: skip
    add("--loopback-ranks", type=arguments.non_negative_int, default=full.loopback_ranks,
        help="gloo ranks comparing with all-reduce, 0 to skip (default: %(default)s)")  # fmt: skip
    bench_options.add_from(parser, "overhead", "rewrite the table")
    bench_options.add_common(parser, "overhead")
    parser.set_defaults(run=_run, parser=parser)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    out = bench_options.prepare(args, "overhead")
    config = overhead.OverheadConfig(
        sizes=args.sizes, partitions=args.partitions, density=args.density,
        repeats=args.repeats, loopback_ranks=args.loopback_ranks,
        loopback_repeats=args.repeats, variant=args.variant,
    )  # fmt: skip
    result = bench_options.measure_or_load(
        args, parser, lambda: overhead.run(config, progress=not args.quiet)
    )
    if result is None:
        return 2
    return bench_options.finish(overhead.write, overhead.markdown, result, out, args)
