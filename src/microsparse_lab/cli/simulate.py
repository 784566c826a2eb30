"""``microsparse simulate``: n virtual workers in one process, and an α–β step-time model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from microsparse_lab import arguments
from microsparse_lab.bench import costmodel, simulate
from microsparse_lab.bench.capture import CaptureError
from microsparse_lab.cli import bench_options
from microsparse_lab.methods.names import NO_EXCHANGE, PEERS, parse_method, split_labels

QUICK = {"workers": (1, 4, 16, 64), "steps": 6, "warmup": 2}


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``microsparse simulate`` to the command parsers."""
    full, model = simulate.SimulateConfig(), simulate.PredictConfig()
    parser = commands.add_parser(
        "simulate",
        help="n virtual workers through every sparsifier: build-up, padding, bytes, selection",
        description="Run n virtual workers in one process, each with its own sparsifier bound "
        "as rank r of n and its own residual, on a shared gradient (captured with microsparse "
        "train --capture-gradients, or synthetic) plus per-worker noise. Reports build-up K/k, "
        "index padding, bytes sent per worker and selection time as functions of n. With "
        "--predict, an alpha-beta model of ring collectives predicts step times; with "
        "--cluster-results, it is compared with microsparse bench cluster's results.json. "
        "Progress (the plan, then a bar with the time left) goes to stderr. Writes simulate.json, "
        "simulate.md, simulate.png (and predict.png) to --out.",
    )
    _add_simulation_options(parser, full)
    _add_prediction_options(parser, model)
    add = parser.add_argument
    bench_options.add_from(parser, "simulate", "take the simulation (to redo a prediction)")
    add("--quick", action="store_true", help=f"n = {','.join(map(str, QUICK['workers']))}, "
        f"{QUICK['steps']} steps")  # fmt: skip
    bench_options.add_common(parser, "simulate")
    parser.set_defaults(run=_run, parser=parser)


def _add_simulation_options(parser: argparse.ArgumentParser, full: simulate.SimulateConfig) -> None:
    add = parser.add_argument
    add(
        "--workers",
        type=bench_options.positive_ints,
        default=None,
        help="worker counts n to simulate (default "
        f"{','.join(map(str, full.workers))}: every sparsifier in a few minutes on two cores, "
        "under 2 GB; --predict takes larger n's message shapes from the largest simulated n "
        f"and says so; --workers {','.join(map(str, simulate.EXACT_WORKERS))} simulates every "
        "n it predicts: tens of minutes, up to ~14 GB)",
    )
    add(
        "--density",
        type=arguments.density,
        default=full.density,
        help="(default: %(default)s: k = 10,768 for the MNIST CNN, the paper's k)",
    )
    add(
        "--steps",
        type=arguments.positive_int,
        default=None,
        help=f"(default {full.steps}; quick {QUICK['steps']})",
    )
    add(
        "--warmup",
        type=int,
        default=None,
        help=f"first steps left out of the medians (default {full.warmup})",
    )
    add(
        "--capture",
        metavar="DIR",
        default=None,
        help="shared gradient: the mean of the ranks captured by microsparse train "
        "--capture-gradients DIR (default: synthetic)",
    )
    add(
        "--numel",
        type=arguments.positive_int,
        default=full.numel,
        help="synthetic d (default: %(default)s, the MNIST CNN)",
    )
    add(
        "--noise-ratio",
        type=arguments.positive_float,
        default=None,
        help="per-worker noise / per-layer rms of the shared gradient (default: estimated "
        f"from the captured ranks, else {simulate.DEFAULT_NOISE_RATIO})",
    )
    add(
        "--threshold-start",
        choices=("settled", "cold"),
        default=full.threshold_start,
        help="settled: adaptive thresholds set to select k at step 0 (default: %(default)s)",
    )
    bench_options.add_sparsifiers(parser)
    add(
        "--value-dtype",
        choices=tuple(simulate.VALUE_BYTES),
        default=full.value_dtype,
        help="values on the wire, as GradientReducer's value_dtype (default: %(default)s)",
    )


def _add_prediction_options(parser: argparse.ArgumentParser, model: simulate.PredictConfig) -> None:
    add = parser.add_argument
    add(
        "--predict",
        action="store_true",
        help="predict step times with the alpha-beta model, from the simulated message shapes "
        "at the nearest simulated n (beyond the largest one: its shapes, noted in the output)",
    )
    add(
        "--rates",
        type=bench_options.positive_floats,
        default=model.rates_gbit,
        help="link rates, Gbit/s (default: 10,25,100)",
    )
    add(
        "--predict-workers",
        type=bench_options.positive_ints,
        default=model.workers,
        help="(default: 16,64,256,1024)",
    )
    add(
        "--predict-numel",
        type=arguments.positive_int,
        default=model.numel,
        help="d of the predicted model (default: %(default)s, ResNet-18)",
    )
    add(
        "--latency-us",
        type=arguments.positive_float,
        default=model.latency_us,
        help="alpha, µs per message (default: %(default)s)",
    )
    add(
        "--algorithms",
        choices=costmodel.ALGORITHMS,
        default=model.algorithms,
        help="ring: every collective a ring; best: the faster of ring and recursive doubling "
        "(default: %(default)s)",
    )
    add(
        "--compute-ms",
        type=float,
        default=model.compute_ms,
        help="forward + backward per step (default: %(default)s: step time without compute)",
    )
    add(
        "--peers",
        type=_peers,
        default=model.peers,
        help="what users would pick instead, predicted beside the sparsifiers: ddp, fp16, "
        "bf16, powersgd(rank=R), by commas; 'none' for no peers (default: "
        f"{','.join(model.peers)})",
    )
    add(
        "--select-results",
        metavar="FILE",
        default=None,
        help="select.json of microsparse bench select: local overhead per sparsifier and n",
    )
    add(
        "--cluster-results",
        metavar="FILE",
        default=None,
        help="results.json of microsparse bench cluster, to validate the model against",
    )


def _peers(text: str) -> tuple[str, ...]:
    if text == NO_EXCHANGE:
        return ()
    names = split_labels(text)
    for name in names:
        try:
            method = parse_method(name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if method.kind != "peer":
            raise argparse.ArgumentTypeError(
                f"{name!r} is not a peer: choose from {', '.join(PEERS)} (the "
                "sparsifiers are chosen with --sparsifiers)"
            )
    return names


def config_from(args: argparse.Namespace) -> simulate.SimulateConfig:
    """The simulation that ``args`` ask for: the defaults, ``--quick``'s, or what is given."""
    preset = QUICK if args.quick else {}
    full = simulate.SimulateConfig()
    return simulate.SimulateConfig(
        workers=args.workers or preset.get("workers", full.workers),
        density=args.density,
        steps=args.steps or preset.get("steps", full.steps),
        warmup=args.warmup if args.warmup is not None else preset.get("warmup", full.warmup),
        capture=args.capture,
        numel=args.numel,
        noise_ratio=args.noise_ratio,
        threshold_start=args.threshold_start,
        value_dtype=args.value_dtype,
        only=args.sparsifiers,
    )


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    out = bench_options.prepare(args, "simulate")
    config = config_from(args)
    try:
        if args.from_file:  # the simulation only: the model is redone below, or left out
            result = json.loads(Path(args.from_file).read_text())
            result.pop("prediction", None)
            result.pop("validation", None)
        else:
            result = simulate.run(config, progress=not args.quiet)
    except (CaptureError, ValueError, OSError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    if args.predict or args.cluster_results:
        model = simulate.PredictConfig(
            rates_gbit=args.rates,
            workers=args.predict_workers,
            numel=args.predict_numel,
            latency_us=args.latency_us,
            compute_ms=args.compute_ms,
            select_results=args.select_results,
            algorithms=args.algorithms,
            peers=args.peers,
        )
        result["prediction"] = simulate.predict(result, model)
    if args.cluster_results:
        result["validation"] = simulate.validate(
            result, args.cluster_results, args.latency_us, args.select_results
        )
    return bench_options.finish(simulate.write, simulate.markdown, result, out, args)
