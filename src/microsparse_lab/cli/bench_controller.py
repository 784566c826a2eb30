"""``microsparse bench controller``: compression ratio error of every threshold rule."""

from __future__ import annotations

import argparse

from microsparse.sparsifiers import THRESHOLD_RULES
from microsparse_lab import arguments
from microsparse_lab.bench import controller
from microsparse_lab.bench.capture import CaptureError
from microsparse_lab.cli import bench_options

QUICK = {"numel": 200_000, "density": 0.05, "steps": 400, "drop_at": 150, "rise_at": 280}


def _rule(text: str) -> str:
    if text not in THRESHOLD_RULES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(THRESHOLD_RULES)}")
    return text


OPTIONS = dict(
    numel=dict(type=arguments.positive_int, help="synthetic d"),
    density=dict(type=arguments.density, help="synthetic density (k = 10,000 of d = 500,000)"),
    steps=dict(type=arguments.positive_int),
    drop_at=dict(type=arguments.positive_int, help="step where the scale drops"),
    rise_at=dict(type=arguments.positive_int, help="step where it rises back"),
    drop_factor=dict(type=arguments.positive_float),
    initial_excess=dict(
        type=arguments.positive_float, help="synthetic: λ_0 selects this many times k at step 0"
    ),
    capture=dict(
        metavar="DIR",
        help="also replay rank 0's gradients from microsparse train --capture-gradients DIR",
    ),
    capture_density=dict(
        type=arguments.density,
        help="density for the captured stream (default: the least with k >= 10,000)",
    ),
    rules=dict(
        type=bench_options.listing(_rule),
        help=f"threshold rules (default: all: {', '.join(THRESHOLD_RULES)})",
    ),
    workers=dict(
        type=arguments.positive_int,
        help="virtual workers; 1 is a GradientReducer without a process group",
    ),
)
"""The options of ControllerConfig's fields, in the order ``--help`` lists them."""


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """actual vs target density per step for every MiCRO threshold rule

    Run MiCRO with every threshold rule on a stationary gradient stream, a stream whose scale drops
    to 0.3x and rises again, and (with --capture) real captured gradients; report steps to converge
    and |K/k - 1|. Writes controller.json, controller.md and density_vs_step.png to --out."""
    config = arguments.config_from(controller.ControllerConfig, args, QUICK)
    if not config.drop_at < config.rise_at <= config.steps:
        parser.error(
            f"arguments --drop-at/--rise-at: need drop-at < rise-at <= steps, got "
            f"{config.drop_at}, {config.rise_at}, {config.steps}"
        )
    return bench_options.run(args, parser, controller, config, (CaptureError, ValueError, OSError))


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    """Add ``microsparse bench controller``."""
    parser = arguments.command(benchmarks, "controller", _run)
    arguments.add_fields(parser, controller.ControllerConfig(), quick=QUICK, **OPTIONS)
    bench_options.add_common(parser, "controller", "rewrite the table and plot")
