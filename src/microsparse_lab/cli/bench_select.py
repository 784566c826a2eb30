"""``microsparse bench select``: per-step selection cost and overhead of every sparsifier."""

from __future__ import annotations

import argparse

import torch

from microsparse_lab import arguments
from microsparse_lab.bench import select
from microsparse_lab.cli import bench_options

QUICK = {"sizes": (1_000_000,), "partitions": (1, 16, 256), "repeats": 5}


OPTIONS = dict(
    **bench_options.shared("sizes", "partitions", "density"),
    repeats=dict(
        type=arguments.positive_int,
        default=None,
        help="timed calls per measurement (default: 15 up to 2 M entries, 7 up to 20 M, "
        f"then 3; quick: {QUICK['repeats']})",
    ),
    budget=dict(
        type=arguments.positive_float,
        help="seconds per measurement: slow ones repeat less, at least 3 times",
    ),
    devices=dict(
        type=bench_options.names,
        default=None,
        help="cpu and/or cuda (default: cpu, and cuda when a GPU is present)",
    ),
    **bench_options.shared("only"),
)
"""The options of SelectConfig's fields, in the order ``--help`` lists them."""


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """per-step cost of every sparsifier's selection and overhead vs top-k and one pass

    Time every sparsifier's selection and its whole per-step overhead (GradientReducer.synchronize()
    with the network taken out) on rank 0 of n, for each vector length d and worker count n, against
    torch.topk over the whole vector and one memory pass over d floats. Medians over repetitions.
    Writes select.json, select.md, select_vs_n.png and overhead_vs_n.png to --out."""
    devices = args.devices or (("cpu", "cuda") if torch.cuda.is_available() else ("cpu",))
    if "cuda" in devices and not torch.cuda.is_available():
        parser.error("argument --devices: cuda is not available here")
    config = arguments.config_from(select.SelectConfig, args, QUICK, devices=tuple(devices))
    return bench_options.run(args, parser, select, config)


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    """Add ``microsparse bench select``."""
    parser = arguments.command(benchmarks, "select", _run)
    arguments.add_fields(parser, select.SelectConfig(), quick=QUICK, **OPTIONS)
    bench_options.add_common(parser, "select", "rewrite the table and plots")
