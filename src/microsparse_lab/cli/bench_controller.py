"""``microsparse bench controller``: compression ratio error of every threshold rule."""

from __future__ import annotations

import argparse

from microsparse.sparsifiers.threshold import THRESHOLD_RULES
from microsparse_lab import arguments
from microsparse_lab.bench import controller
from microsparse_lab.bench.capture import CaptureError
from microsparse_lab.cli import bench_options

QUICK = {"numel": 200_000, "density": 0.05, "steps": 400, "drop_at": 150, "rise_at": 280}


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    """Add ``microsparse bench controller``."""
    full = controller.ControllerConfig()
    parser = benchmarks.add_parser(
        "controller",
        help="actual vs target density per step for every MiCRO threshold rule",
        description="Run MiCRO with every threshold rule on a stationary gradient stream, a "
        "stream whose scale drops to 0.3x and rises again, and (with --capture) real captured "
        "gradients; report steps to converge and |K/k - 1|. Writes controller.json, "
        "controller.md and density_vs_step.png to --out.",
    )
    add = parser.add_argument
    add(
        "--numel",
        type=arguments.positive_int,
        default=None,
        help=f"synthetic d (default {full.numel:,}; quick {QUICK['numel']:,})",
    )
    add(
        "--density",
        type=arguments.density,
        default=None,
        help=f"synthetic density (default {full.density}, k = 10,000; quick {QUICK['density']})",
    )
    add(
        "--steps",
        type=arguments.positive_int,
        default=None,
        help=f"(default {full.steps}; quick {QUICK['steps']})",
    )
    add(
        "--drop-at",
        type=arguments.positive_int,
        default=None,
        help=f"step where the scale drops (default {full.drop_at}; quick {QUICK['drop_at']})",
    )
    add(
        "--rise-at",
        type=arguments.positive_int,
        default=None,
        help=f"step where it rises back (default {full.rise_at}; quick {QUICK['rise_at']})",
    )
    add(
        "--drop-factor",
        type=arguments.positive_float,
        default=full.drop_factor,
        help="(default: %(default)s)",
    )
    add(
        "--initial-excess",
        type=arguments.positive_float,
        default=full.initial_excess,
        help="synthetic: λ_0 selects this many times k at step 0 (default: %(default)s)",
    )
    add(
        "--capture",
        metavar="DIR",
        default=None,
        help="also replay rank 0's gradients from microsparse train --capture-gradients DIR",
    )
    add(
        "--capture-density",
        type=arguments.density,
        default=None,
        help="density for the captured stream (default: the least with k >= 10,000)",
    )
    add(
        "--rules",
        type=bench_options.listing(_rule),
        default=None,
        help=f"threshold rules (default: all: {', '.join(THRESHOLD_RULES)})",
    )
    add(
        "--workers",
        type=arguments.positive_int,
        default=1,
        help="virtual workers; 1 is a GradientReducer without a process group (default: 1)",
    )
    bench_options.add_from(parser, "controller", "rewrite the table and plot")
    add("--quick", action="store_true", help="d = 200,000 at density 0.05, 400 steps")
    bench_options.add_common(parser, "controller")
    parser.set_defaults(run=_run, parser=parser)


def _rule(text: str) -> str:
    if text not in THRESHOLD_RULES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(THRESHOLD_RULES)}")
    return text


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    out = bench_options.prepare(args, "controller")
    preset = QUICK if args.quick else {}
    chosen = {
        name: getattr(args, name) if getattr(args, name) is not None else preset.get(name)
        for name in ("numel", "density", "steps", "drop_at", "rise_at")
    }
    config = controller.ControllerConfig(
        **{name: value for name, value in chosen.items() if value is not None},
        drop_factor=args.drop_factor,
        initial_excess=args.initial_excess,
        capture=args.capture,
        capture_density=args.capture_density,
        rules=args.rules,
        workers=args.workers,
    )
    if not config.drop_at < config.rise_at <= config.steps:
        parser.error(
            f"arguments --drop-at/--rise-at: need drop-at < rise-at <= steps, got "
            f"{config.drop_at}, {config.rise_at}, {config.steps}"
        )
    result = bench_options.measure_or_load(
        args,
        parser,
        lambda: controller.run(config, progress=not args.quiet),
        (CaptureError, ValueError, OSError),
    )
    if result is None:
        return 2
    return bench_options.finish(controller.write, controller.markdown, result, out, args)
