"""``microsparse train``: data-parallel training of a task, spawned locally or under torchrun.

Options come, later ones winning, from the task's recipe, a JSON ``--config`` file, and the
command line; ``--resume DIR`` continues a checkpointed run with its own config.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, NoReturn

import torch

from microsparse.sparsifiers import create_sparsifier
from microsparse_lab import arguments
from microsparse_lab.arguments import add_fields, flag
from microsparse_lab.training.checkpoint import CheckpointError, read_meta, verify_checkpoint
from microsparse_lab.training.config import (
    RECIPE_FIELDS,
    ConfigError,
    TrainConfig,
    config_from_file,
    option_named_in,
    resume_config,
)
from microsparse_lab.training.data import DataFormatError, MissingDataError
from microsparse_lab.training.launch import WorkerError, launch, torchrun_env
from microsparse_lab.training.loop import steps_in_epoch
from microsparse_lab.training.rundir import ForeignFileError, claim, earlier_run, refusal
from microsparse_lab.training.tasks import available_tasks, get_task

DEFAULT_WORKERS = 4
_FIELDS = {f.name for f in fields(TrainConfig)}


_AVERAGING = (
    "sparsifier", "density", "budget", "selection", "threshold_rule", "partitioning",
    "index_message", "wire", "value_dtype", "momentum_correction", "adam_correction",
    "density_warmup",
    "integration", "shards", "ddp_hook", "one_exchange", "min_speedup",
)  # fmt: skip
"""The TrainConfig fields of the "gradient averaging" options, in the order --help lists."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``microsparse train`` to the command parsers; the options are TrainConfig's."""
    tasks = ", ".join(f"{name} ({get_task(name).description})" for name in available_tasks())
    train = arguments.command(commands, "train", _train, tasks=tasks)
    what = train.add_argument_group("what to train")
    add_fields(what, TrainConfig, "task", "model", "data_dir", "model_options", "task_options")
    what.add_argument(
        "--config",
        metavar="FILE",
        help="JSON object of options, keyed by TrainConfig field names (e.g. lr, betas, "
        "model_options); the command line wins",
    )
    averaging = train.add_argument_group("gradient averaging")
    averaging.add_argument(
        "--workers",
        type=arguments.positive_int,
        help=f"local worker processes (default {DEFAULT_WORKERS}; under torchrun: WORLD_SIZE)",
    )
    add_fields(averaging, TrainConfig, *_AVERAGING)
    recipe = train.add_argument_group("recipe (default: the task's)")
    add_fields(recipe, TrainConfig, *(name for name in RECIPE_FIELDS if name != "betas"))
    run = train.add_argument_group("the run")
    add_fields(
        run, TrainConfig, "seed", "out", "device", "max_steps", "timeout", "checkpoint_every"
    )
    run.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the checkpointed run in DIR exactly; with no checkpoint there yet, start "
        "a fresh run in DIR (so one command line serves the first start and every restart)",
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run in the directory that finished or has a checkpoint "
        "(its files and checkpoint; a file microsparse did not write is never replaced)",
    )
    add_fields(run, TrainConfig, "capture_gradients", "capture_steps", "progress", "log_every")


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """data-parallel training of the paper's workloads with a sparsifier

    Data-parallel training, averaging gradients with a sparsifier. Spawns --workers local processes,
    or runs as one rank under torchrun. Tasks: {tasks}. Hyper-parameters left out come from the
    task's recipe (the paper's for real data)."""
    env = torchrun_env()
    given, saved_workers = _config(args, parser)
    workers = args.workers or saved_workers or DEFAULT_WORKERS
    if env is not None:
        if args.workers is not None and args.workers != env.world_size:
            parser.error(
                f"argument --workers: {args.workers} disagrees with torchrun's WORLD_SIZE="
                f"{env.world_size}; omit --workers under torchrun"
            )
        workers = env.world_size
    if saved_workers is not None and workers != saved_workers:
        parser.error(
            f"argument --workers: the checkpoint was written by {saved_workers} workers; "
            f"resume with {saved_workers}"
        )
    local_workers = workers if env is None else env.local_world_size
    try:  # what a budget buys can depend on the number of ranks that average
        config = given.resolved(given.averaging_ranks(workers))
    except ConfigError as error:
        _config_error(error, args, parser)
    if given.resume and given.value_dtype is None and config.value_dtype is not None:
        parser.error(
            f"argument --resume: {args.resume} holds a checkpoint of a run that did not record "
            f"the dtype its values travelled in (written before runs recorded it, under a "
            f"default that may differ from this version's {config.value_dtype}), so it could "
            "not be sure to continue as it began: start it afresh, or finish it with the "
            "version that started it"
        )
    device = _resolve_device(args.device, local_workers, parser)
    config = replace(config, device=device)
    writes = env is None or env.rank == 0  # only rank 0 writes
    if writes:
        _check_out(config, args, parser)
    data = _check_before_spawning(config, workers, parser, _from_file(args), args.config)
    if writes:
        try:
            claim(config.out)
        except OSError as error:
            parser.error(
                f"argument --out: cannot create directory {config.out!r}: {error.strerror}"
            )
        except ForeignFileError as error:  # put there since _check_out looked
            parser.error(f"argument --out: {error}")
    try:
        launch(config, workers, data)
    except WorkerError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    return 0


def _config(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[TrainConfig, int | None]:
    """The config, not yet resolved (what a budget buys can depend on the number of
    workers), and the checkpoint's worker count when resuming."""
    given = _given(args)
    try:
        if args.resume is not None:
            if args.out is not None and Path(args.out) != Path(args.resume):
                parser.error("argument --out: a resumed run continues in its --resume directory")
            try:
                meta = read_meta(args.resume)
                if meta is not None:
                    verify_checkpoint(args.resume, int(meta["world_size"]))
            except CheckpointError as error:
                parser.error(f"argument --resume: {error}")
            if meta is not None:
                # resolved (so checked) for its workers by the caller
                return resume_config(meta["config"], given, args.resume), int(meta["world_size"])
            # The same command line serves the first start and every restart (torchrun
            # --max-restarts): with nothing to resume yet, the run starts in that directory.
            given["out"] = args.resume
        values = config_from_file(args.config) if args.config else {}
        values.update(given)
        if values.get("density") is not None and values.get("budget") is not None:
            raise ConfigError("budget", "give --density or --budget, not both: the budget sets "
                                        "the density; leave --density out")  # fmt: skip
        task, sparsifier = values.get("task", "mnist"), values.get("sparsifier", "micro")
        if values.get("ddp_hook", "microsparse") != "microsparse":
            sparsifier = values["ddp_hook"]
        values.setdefault("out", f"runs/{task}-{sparsifier}-{time.strftime('%Y%m%d-%H%M%S')}")
        if values.get("capture_gradients"):
            values.setdefault("capture_steps", 1)
        return TrainConfig(**values), None  # resolved (so checked) for its workers by the caller
    except ConfigError as error:
        _config_error(error, args, parser)


def _config_error(
    error: ConfigError, args: argparse.Namespace, parser: argparse.ArgumentParser
) -> NoReturn:
    """Exit, naming the flag (or the --config file) whose value cannot work."""
    if error.field != "config" and error.field in _from_file(args):
        parser.error(f"argument --config: {args.config}: {error.message}")
    parser.error(f"argument {flag(TrainConfig, error.field)}: {error.message}")


def _from_file(args: argparse.Namespace) -> set[str]:
    """The fields the run takes from ``--config`` (those not also on the command line); none
    from a file that cannot be read (its own error says so)."""
    try:
        return set(config_from_file(args.config)) - set(_given(args)) if args.config else set()
    except ConfigError:
        return set()


def _check_out(
    config: TrainConfig, args: argparse.Namespace, parser: argparse.ArgumentParser
) -> None:
    """Refuse, before any file is touched, to start where the run would replace what it may
    not: a user's file, or without --overwrite an earlier run that finished or can continue."""
    option = "--out" if args.resume is None else "--resume"
    problem = refusal(config.out, option, args.resume is not None, args.overwrite)
    if problem is not None:
        parser.error(f"argument {option}: {problem}")
    if config.resume:
        return  # its captured gradients, if any, are this run's
    if config.capture_gradients:
        _check_capture(Path(config.capture_gradients), args.overwrite, parser)
    if args.resume is not None:
        print(f"{parser.prog}: no checkpoint in {args.resume} yet: starting a fresh run there",
              file=sys.stderr)  # fmt: skip
    elif earlier_run(config.out) is not None:
        print(f"{parser.prog}: replacing the earlier run in {config.out}", file=sys.stderr)


def _check_capture(directory: Path, overwrite: bool, parser: argparse.ArgumentParser) -> None:
    """Earlier captured gradients are replaced only with --overwrite."""
    layout = directory / "layout.json"
    captured = layout if layout.exists() else next(directory.glob("grad-rank*-step*.pt"), None)
    if captured is not None and not overwrite:
        parser.error(
            f"argument --capture-gradients: {directory} already holds captured gradients "
            f"({captured}): add --overwrite to replace them, or choose another "
            "--capture-gradients directory"
        )


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields set on the command line."""
    given = {
        name: value
        for name, value in vars(args).items()
        if name in _FIELDS and value is not None and name not in ("out", "resume", "device")
    }
    if args.out is not None:
        given["out"] = args.out
    for name in ("model_options", "task_options"):
        if name in given:
            given[name] = dict(given[name])
    if args.checkpoint_every == "epoch":
        given.update(checkpoint_every=0, checkpoint_per_epoch=True)
    return given


def _check_before_spawning(
    config: TrainConfig,
    workers: int,
    parser: argparse.ArgumentParser,
    from_file: set[str] = frozenset(),  # type: ignore[assignment]
    config_file: str | None = None,
) -> Any:
    """Everything a worker would otherwise fail on, reported once; returns the loaded data.

    An error about a value that came from ``--config`` names that file."""
    options = config.sparsifier_options()
    try:
        create_sparsifier(config.sparsifier, config.density, **options)
    except (TypeError, ValueError) as error:
        field = option_named_in(str(error))
        if field in from_file:
            parser.error(f"argument --config: {config_file}: {error}")
        parser.error(f"argument --{field.replace('_', '-')}: {error}")
    cores = os.cpu_count() or 1
    if torchrun_env() is None and workers > cores:
        print(f"{parser.prog}: warning: {workers} workers on {cores} cores: every worker waits "
              "for a core (and holds its own copy of the model and data in memory)",
              file=sys.stderr)  # fmt: skip
    task = get_task(config.task)
    try:
        task.check_data_dir(config.data_dir)
        data = task.load(config.data_dir, config.task_options)
    except (MissingDataError, DataFormatError) as error:
        parser.error(f"argument --data-dir: {error}")
    except (ModuleNotFoundError, FileNotFoundError) as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    try:
        steps_in_epoch(task, data, config, workers)
    except ValueError as error:
        parser.error(f"argument --batch-size: {error}")
    return data


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
