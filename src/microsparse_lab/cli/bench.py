"""``microsparse bench``: benchmarks, one sub-command each (``microsparse bench cluster``, …).

To add a benchmark, append to :data:`BENCHMARKS` a function that adds its sub-command parser
(setting ``run`` and ``parser`` like every command), e.g. a module's ``add_parser``.
"""

from __future__ import annotations

import argparse
import sys
import time

from microsparse.sparsifiers import available_sparsifiers
from microsparse_lab import arguments
from microsparse_lab.bench import netns
from microsparse_lab.bench.cluster import QUICK, BenchConfig, BenchError, refusal, run_benchmark
from microsparse_lab.bench.cluster_worker import MODELS
from microsparse_lab.cli import (
    bench_accuracy,
    bench_controller,
    bench_options,
    bench_overhead,
    bench_select,
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``microsparse bench`` and its benchmarks to the command parsers."""
    bench = commands.add_parser(
        "bench",
        help="benchmarks: step time, selection cost, ...",
        description="Benchmarks. `microsparse bench BENCHMARK --help` describes each.",
    )
    benchmarks = bench.add_subparsers(title="benchmarks", required=True, metavar="BENCHMARK")
    for add_benchmark in BENCHMARKS:
        add_benchmark(benchmarks)


def add_cluster(benchmarks: argparse._SubParsersAction) -> None:
    """``microsparse bench cluster``: hosts as network namespaces on shaped links."""
    cluster = arguments.command(benchmarks, "cluster", _cluster)
    names = ", ".join(available_sparsifiers())
    arguments.add_fields(
        cluster,
        BenchConfig(),
        quick=QUICK,
        hosts=dict(
            type=bench_options.listing(bench_options.host_count),
            help="host counts, comma-separated",
        ),
        **bench_options.shared("rates"),
        sparsifiers=dict(
            type=bench_options.methods,
            help=f"methods: a sparsifier ({names}) for the loop API, NAME@ddp for the DDP hook "
            "(NAME@ddp(buckets=one): with one DDP bucket; NAME@ddp(exchange=one): one exchange "
            "after DDP's last bucket; NAME(density=D) selects at D instead of --density), or a "
            "peer: ddp, fp16, bf16, powersgd(rank=R); none@ddp (DDP's own cost, no exchange) and "
            "none (the no-exchange bound)",
        ),
        **bench_options.shared("density"),
        steps=dict(type=arguments.positive_int, help="recorded steps per sparsifier"),
        warmup=dict(type=arguments.non_negative_int, help="unrecorded steps before every round"),
        rounds=dict(
            type=arguments.positive_int,
            help="passes over the sparsifiers, sharing --steps, so that a burst of load from "
            "elsewhere hits them all",
        ),
        model=dict(
            choices=sorted(MODELS),
            help="resnet18: the CIFAR ResNet-18 (11,173,962 parameters); tiny: 1,514, for tests",
        ),
        batch_size=dict(
            type=arguments.positive_int, help="random CIFAR-shaped images per worker and step"
        ),
        threshold_start=dict(
            choices=("settled", "cold"),
            help="settled: warm-up sets thresholds that adapt slowly from step to step (MiCRO's "
            "paper rules, SAGE) to select the target count; cold: leave them at their start",
        ),
        timeout=dict(type=arguments.positive_float, help="seconds per (hosts, rate) configuration"),
    )
    add = cluster.add_argument
    add("--out", default=None, help="output directory (default runs/bench-cluster-TIMESTAMP)")
    add(
        "--remove-stale",
        action="store_true",
        help="only remove namespaces left by a run that was killed with SIGKILL, and exit",
    )


BENCHMARKS = [
    add_cluster,
    bench_accuracy.add_parser,
    bench_select.add_parser,
    bench_overhead.add_parser,
    bench_controller.add_parser,
]
"""Functions that each add one ``microsparse bench`` sub-command, given the sub-parsers."""


def _cluster(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """step time of every sparsifier on a real, bandwidth-limited cluster (needs root)

    Build 2 and 4 hosts as network namespaces on a bridge, every link shaped with tc tbf (1 Gbit/s,
    100 Mbit/s), run one gloo worker per host, and time training steps (compute, select, exchange)
    with dense, every sparsifier, and `none` (the same training without any exchange). Writes
    results.json, results.md and cluster.png to --out. Needs root and iproute2; removes every
    namespace it made, also on Ctrl-C."""
    problem = refusal()
    if problem:
        print(f"{parser.prog}: error: {problem}", file=sys.stderr)
        return 2
    if args.remove_stale:
        removed = netns.remove_stale_namespaces()
        print(f"removed {len(removed)} stale namespace(s){': ' if removed else ''}"
              f"{', '.join(removed)}")  # fmt: skip
        return 0
    out = args.out or f"runs/bench-cluster-{time.strftime('%Y%m%d-%H%M%S')}"
    config = arguments.config_from(BenchConfig, args, QUICK, out=out)
    stale = netns.stale_namespaces()
    if stale:
        print(f"note: {len(stale)} namespace(s) left by a killed run; remove them with "
              f"`{parser.prog} --remove-stale`")  # fmt: skip
    return bench_options.on_testbed(parser, run_benchmark, config, (BenchError,))
