"""``microsparse bench accuracy``: time to accuracy on the test bed, per method and network."""

from __future__ import annotations

import argparse
import sys
import time

from microsparse_lab import arguments
from microsparse_lab.bench import accuracy
from microsparse_lab.bench.cluster import BenchError, refusal
from microsparse_lab.cli import bench_options
from microsparse_lab.reports import RunError

OPTIONS = dict(
    task=dict(),
    hosts=dict(type=bench_options.host_count),
    ranks_per_host=dict(
        type=arguments.positive_int,
        help="ranks on each host, talking over its loopback (NAME@fsdp shards among them)",
    ),
    **bench_options.shared("rates"),
    methods=dict(
        type=bench_options.methods,
        help="dense and what to compare: sparsifiers (loop), NAME@ddp (the hook), NAME@fsdp "
        "(FSDP2, hosts averaging sparsely; dense@fsdp: hybrid sharding), ddp, fp16, bf16, "
        "powersgd(rank=R); NAME(density=D) trains at D instead of --density, "
        "NAME(budget=B) at byte budget B",
    ),
    density=dict(  # None when not given, to tell it from --budget
        **bench_options.shared("density")["density"], default=None,
        help="fraction of gradient entries sent per step (default: train's, what 0.2 %% of "
        "dense's bytes buy)",
    ),
    budget=dict(
        type=arguments.budget,
        help="instead of --density: the fraction of dense's bytes each method sends per "
        "step (train --budget)",
    ),
    seed=dict(type=int),
    target_fraction=dict(
        type=arguments.positive_float,
        help="target: this fraction of the dense run's final metric (lower is better: "
        "2 - fraction of it)",
    ),
    timeout=dict(type=arguments.positive_float, help="seconds one training may take"),
)
"""The options of AccuracyConfig's fields, in the order ``--help`` lists them."""


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    """Add ``microsparse bench accuracy``."""
    parser = arguments.command(benchmarks, "accuracy", _run)
    arguments.add_fields(parser, accuracy.AccuracyConfig(), **OPTIONS)
    add = parser.add_argument
    add("--out", default=None, help="output directory (default runs/bench-accuracy-TIMESTAMP)")
    add("train_args", nargs="*", metavar="-- TRAIN_OPTION", help="passed to every training")


OWNED = (
    "--task", "--density", "--budget", "--seed", "--out", "--sparsifier", "--integration",
    "--ddp-hook", "--workers", "--device", "--config", "--selection", "--threshold-rule",
    "--partitioning", "--index-message", "--wire",
)  # fmt: skip
"""``microsparse train`` options that ``bench accuracy`` sets itself, per method."""


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """time to accuracy on the namespace test bed: real training per method and link rate (needs
    root)

    For every link rate, build the namespace test bed (as bench cluster) and run microsparse train
    once per method, one rank per host, into OUT/RATE/METHOD; then report per rate the metric
    against epochs and wall time and, per method, the epochs, seconds, steps and MB per worker to
    the target (a fraction of the dense run's final metric, fixed here in advance). Options after --
    go to every microsparse train (e.g. -- --epochs 10)."""
    given = [arg.split("=")[0] for arg in args.train_args if arg.startswith("--")]
    clash = sorted({o for arg in given for o in OWNED if len(arg) > 3 and o.startswith(arg)})
    if clash:
        parser.error(f"{', '.join(clash)} after --: set by bench accuracy itself (use its own "
                     "options)")  # fmt: skip
    if args.density is not None and args.budget is not None:
        parser.error("argument --budget: give --density or --budget, not both")
    try:  # checked before anything is built, and before the refusal of non-root
        out = args.out or f"runs/bench-accuracy-{time.strftime('%Y%m%d-%H%M%S')}"
        train_args = tuple(args.train_args)
        config = arguments.config_from(
            accuracy.AccuracyConfig, args, train_args=train_args, out=out
        )
    except ValueError as error:
        field, _, problem = str(error).partition(": ")
        parser.error(f"argument --{field.replace('_', '-')}: {problem}")
    problem = refusal(command="accuracy")
    if problem:
        print(f"{parser.prog}: error: {problem}", file=sys.stderr)
        return 2
    return bench_options.on_testbed(parser, accuracy.run_accuracy, config, (BenchError, RunError))
