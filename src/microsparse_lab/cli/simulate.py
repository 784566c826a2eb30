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
    parser = arguments.command(commands, "simulate", _run)
    _add_simulation_options(parser, full)
    _add_prediction_options(parser, model)
    redo = "take the simulation (to redo a prediction)"
    bench_options.add_common(parser, "simulate", redo)


def _add_simulation_options(parser: argparse.ArgumentParser, full: simulate.SimulateConfig) -> None:
    exact = ",".join(map(str, simulate.EXACT_WORKERS))
    arguments.add_fields(
        parser,
        full,
        quick=QUICK,
        workers=dict(
            type=bench_options.positive_ints,
            help="worker counts n to simulate: every sparsifier in a few minutes on two cores, "
            "under 2 GB, by default; --predict takes larger n's message shapes from the largest "
            f"simulated n and says so; --workers {exact} simulates every n it predicts: tens of "
            "minutes, up to ~14 GB",
        ),
        density=dict(
            type=arguments.density,
            help="(default: %(default)s: k = 10,768 for the MNIST CNN, the paper's k)",
        ),
        steps=dict(type=arguments.positive_int),
        warmup=dict(type=int, help="first steps left out of the medians"),
        capture=dict(
            metavar="DIR",
            help="shared gradient: the mean of the ranks captured by microsparse train "
            "--capture-gradients DIR (default: synthetic)",
        ),
        numel=dict(
            type=arguments.positive_int, help="synthetic d (default: %(default)s, the MNIST CNN)"
        ),
        noise_ratio=dict(
            type=arguments.positive_float,
            help="per-worker noise / per-layer rms of the shared gradient (default: estimated "
            f"from the captured ranks, else {simulate.DEFAULT_NOISE_RATIO})",
        ),
        threshold_start=dict(
            choices=("settled", "cold"),
            help="settled: adaptive thresholds set to select k at step 0",
        ),
        **bench_options.shared("only"),
        value_dtype=dict(
            choices=tuple(simulate.VALUE_BYTES),
            help="values on the wire, as GradientReducer's value_dtype",
        ),
    )


def _add_prediction_options(parser: argparse.ArgumentParser, model: simulate.PredictConfig) -> None:
    parser.add_argument(
        "--predict",
        action="store_true",
        help="predict step times with the alpha-beta model, from the simulated message shapes "
        "at the nearest simulated n (beyond the largest one: its shapes, noted in the output)",
    )
    arguments.add_fields(
        parser,
        model,
        rates_gbit=dict(
            flag="--rates",
            metavar="RATES",
            type=bench_options.positive_floats,
            help="link rates, Gbit/s (default: 10,25,100)",
        ),
    )
    arguments.add_fields(
        parser,
        model,
        prefix="predict_",
        workers=dict(type=bench_options.positive_ints),
        numel=dict(
            type=arguments.positive_int,
            help="d of the predicted model (default: %(default)s, ResNet-18)",
        ),
    )
    arguments.add_fields(
        parser,
        model,
        latency_us=dict(type=arguments.positive_float, help="alpha, µs per message"),
        algorithms=dict(
            choices=costmodel.ALGORITHMS,
            help="ring: every collective a ring; best: the faster of ring and recursive doubling",
        ),
        compute_ms=dict(
            type=float,
            help="forward + backward per step (default: %(default)s: step time without compute)",
        ),
        peers=dict(
            type=_peers,
            help="what users would pick instead, predicted beside the sparsifiers: ddp, fp16, "
            "bf16, powersgd(rank=R), by commas; 'none' for no peers",
        ),
        select_results=dict(
            metavar="FILE",
            help="select.json of microsparse bench select: local overhead per sparsifier and n",
        ),
    )
    parser.add_argument(
        "--cluster-results",
        metavar="FILE",
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
    return arguments.config_from(simulate.SimulateConfig, args, QUICK)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """n virtual workers through every sparsifier: build-up, padding, bytes, selection

    Run n virtual workers in one process, each with its own sparsifier bound as rank r of n and its
    own residual, on a shared gradient (captured with microsparse train --capture-gradients, or
    synthetic) plus per-worker noise. Reports build-up K/k, index padding, bytes sent per worker and
    selection time as functions of n. With --predict, an alpha-beta model of ring collectives
    predicts step times; with --cluster-results, it is compared with microsparse bench cluster's
    results.json. Progress (the plan, then a bar with the time left) goes to stderr. Writes
    simulate.json, simulate.md, simulate.png (and predict.png) to --out."""
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
        model = arguments.config_from(
            simulate.PredictConfig, args, workers=args.predict_workers, numel=args.predict_numel
        )
        result["prediction"] = simulate.predict(result, model)
    if args.cluster_results:
        result["validation"] = simulate.validate(
            result, args.cluster_results, args.latency_us, args.select_results
        )
    return bench_options.finish(simulate.write, simulate.markdown, result, out, args)
