"""``microsparse train``: data-parallel training of a task, spawned locally or under torchrun.

Options come, later ones winning, from the task's recipe, a JSON ``--config`` file, and the
command line; ``--resume DIR`` continues a checkpointed run with its own config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from microsparse.sparsifiers import available_sparsifiers, create_sparsifier
from microsparse.sparsifiers.micro import INDEX_MESSAGES, SELECTIONS
from microsparse.sparsifiers.partition import PARTITIONINGS
from microsparse.sparsifiers.threshold import THRESHOLD_RULES
from microsparse_lab import arguments
from microsparse_lab.training.checkpoint import CheckpointError, read_meta, verify_checkpoint
from microsparse_lab.training.config import (
    VALUE_DTYPES,
    ConfigError,
    TrainConfig,
    config_from_file,
    resume_config,
)
from microsparse_lab.training.data import DataFormatError, MissingDataError
from microsparse_lab.training.launch import WorkerError, launch, torchrun_env
from microsparse_lab.training.loop import steps_in_epoch
from microsparse_lab.training.rundir import ForeignFileError, claim, earlier_run, refusal
from microsparse_lab.training.tasks import Task, available_tasks, get_task

DEFAULT_WORKERS = 4
DEFAULTS = TrainConfig()
_FIELDS = {f.name for f in fields(TrainConfig)}
_OPTION_OF = {"model_options": "--model-option", "task_options": "--task-option"}


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``microsparse train`` to the command parsers."""
    tasks = ", ".join(f"{name} ({get_task(name).description})" for name in available_tasks())
    train = commands.add_parser(
        "train",
        help="data-parallel training of the paper's workloads with a sparsifier",
        description="Data-parallel training, averaging gradients with a sparsifier. Spawns "
        "--workers local processes, or runs as one rank under torchrun. Tasks: " + tasks + ". "
        "Hyper-parameters left out come from the task's recipe (the paper's for real data).",
    )
    _add_task_options(train.add_argument_group("what to train"))
    averaging = train.add_argument_group("gradient averaging")
    _add_averaging_options(averaging)
    _add_integration_options(averaging)
    _add_recipe_options(train.add_argument_group("recipe (default: the task's)"))
    _add_run_options(train.add_argument_group("the run"))
    train.set_defaults(run=_train, parser=train)


def _add_task_options(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--task", choices=available_tasks(), default=None, help="(default: mnist)")
    add("--model", default=None, help="a model of the task: " + _per_task(_models))
    add("--data-dir", default=None, help="real data (default: the task's embedded data)")
    add(
        "--model-option",
        action="append",
        type=_assignment,
        metavar="NAME=VALUE",
        help="a model's option (repeatable; value parsed as JSON if it can be): "
        + _per_task(_model_options),
    )
    add(
        "--task-option",
        action="append",
        type=_assignment,
        metavar="NAME=VALUE",
        help="a task's option (repeatable): " + _per_task(_task_options),
    )
    add(
        "--config",
        metavar="FILE",
        help="JSON object of options, keyed by TrainConfig field names (e.g. lr, betas, "
        "model_options); the command line wins",
    )


def _add_averaging_options(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add(
        "--workers",
        type=arguments.positive_int,
        default=None,
        help=f"local worker processes (default {DEFAULT_WORKERS}; under torchrun: WORLD_SIZE)",
    )
    add(
        "--sparsifier",
        choices=available_sparsifiers(),
        help=f"how gradient entries are selected (default: {DEFAULTS.sparsifier})",
    )
    add(
        "--density",
        type=arguments.density,
        help=f"fraction of gradient entries sent per step, in (0, 1] (default: {DEFAULTS.density})",
    )
    add(
        "--selection",
        choices=SELECTIONS,
        help="MiCRO's selection: quota (every rank sends k/n entries) or threshold (one "
        "shared threshold) (default: quota, or threshold with --threshold-rule)",
    )
    add(
        "--threshold-rule",
        choices=THRESHOLD_RULES,
        help="MiCRO's shared threshold: quantile, or the paper's per-step corrections "
        "(default: quantile)",
    )
    add(
        "--partitioning",
        choices=tuple(PARTITIONINGS),
        help="MiCRO's partitions: interleaved blocks or the paper's contiguous ranges "
        "(default: interleaved)",
    )
    add(
        "--index-message",
        choices=INDEX_MESSAGES,
        help="MiCRO's index message: fixed (carries its own count) or the paper's padded one "
        "after a count round (default: fixed). The reference code is --threshold-rule as_coded "
        "--partitioning contiguous --index-message padded",
    )
    add(
        "--value-dtype",
        choices=VALUE_DTYPES,
        help="send the selected values in 16 bits: 6 bytes an entry with its 4-byte index "
        "instead of 8; what rounding takes stays in the residual (default: float32)",
    )
    add(
        "--momentum-correction",
        action="store_true",
        default=None,
        help="accumulate the recipe's momentum in the error feedback (Deep Gradient "
        "Compression) instead of applying it in the optimiser to the sparse average",
    )
    add(
        "--adam-correction",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with the recipe's Adam: each worker accumulates its own Adam step in the error "
        "feedback, and plain SGD applies the sparse average (default: on for an Adam recipe "
        "without weight decay or --clip and a sparsifier with error feedback, as the "
        "recommendation task's)",
    )
    add(
        "--density-warmup",
        type=arguments.density_warmup,
        metavar="START,EPOCHS",
        help="start at density START and decay exponentially to --density over EPOCHS "
        "epochs (the extra traffic counts in the run's mean density)",
    )


def _add_integration_options(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add(
        "--integration",
        choices=("loop", "ddp"),
        help="loop: GradientReducer.synchronize() after backward; ddp: DistributedDataParallel "
        "with the sparse comm hook (the same step, overlapped with backward) (default: loop)",
    )
    add(
        "--ddp-hook",
        metavar="HOOK",
        help="with --integration ddp: microsparse (the sparse hook, --sparsifier), or what "
        "users would pick instead, for comparison: ddp (stock DDP), fp16, bf16 (torch's "
        "compression hooks), powersgd(rank=R,start=S) (torch's powerSGD_hook with one bucket "
        "holding the whole model, plain all-reduce for S steps (default 2), then compressed); "
        "--sparsifier and "
        "--density are then unused (default: microsparse)",
    )
    add(
        "--one-exchange",
        action="store_true",
        default=None,
        help="with --integration ddp: average the whole model in one exchange after its last "
        "DDP bucket, instead of one exchange per bucket (fewer collective rounds, no overlap "
        "with backward)",
    )
    add(
        "--min-speedup",
        type=arguments.positive_float,
        metavar="X",
        help="with --integration ddp: time a few steps sparse and dense, then stay sparse only "
        "if its step is at least X times faster, else average densely as DDP does (default: "
        "always sparse)",
    )


def _add_recipe_options(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--epochs", type=arguments.positive_int)
    add("--batch-size", type=arguments.positive_int, help="per worker")
    add("--optimizer", choices=("sgd", "adam"))
    add("--lr", type=arguments.positive_float, help="base learning rate")
    add(
        "--lr-reference-batch",
        type=arguments.non_negative_int,
        help="the lr is scaled by batch size x workers / this (0: not scaled)",
    )
    add("--momentum", type=arguments.momentum, help="SGD momentum, in [0, 1)")
    add("--nesterov", action=argparse.BooleanOptionalAction, default=None)
    add("--weight-decay", type=_non_negative, help="not applied to batch-norm parameters")
    add("--warmup-epochs", type=_non_negative, help="linear warm-up from lr / workers")
    add("--decay-epochs", type=_epoch_list, help="comma-separated epochs where lr decays")
    add("--decay-factor", type=arguments.positive_float)
    add("--clip", type=_non_negative, help="max norm of the averaged gradient (0: none)")


def _add_run_options(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add(
        "--seed",
        type=int,
        help="model initialisation, data order and augmentation; the data split is fixed "
        f"(default: {DEFAULTS.seed})",
    )
    add("--out", default=None, help="output directory (default runs/TASK-SPARSIFIER-TIMESTAMP)")
    add(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto picks cuda when available; cuda runs one worker per GPU with NCCL, "
        "cpu uses gloo (default: %(default)s)",
    )
    add("--max-steps", type=arguments.positive_int, help="stop after this many steps in all")
    add(
        "--timeout",
        type=arguments.positive_float,
        metavar="SECONDS",
        help="end the job when a peer has not joined a collective for this long (stopped, "
        "hung or gone) (default: torch's, 30 minutes)",
    )
    add(
        "--checkpoint-every",
        type=_checkpoint_every,
        metavar="N|epoch",
        help="checkpoint into OUT/checkpoint every N steps, or after every epoch (and at the end)",
    )
    add(
        "--resume",
        metavar="DIR",
        help="continue the checkpointed run in DIR exactly; with no checkpoint there yet, start "
        "a fresh run in DIR (so one command line serves the first start and every restart)",
    )
    add(
        "--overwrite",
        action="store_true",
        help="replace an earlier run in the directory that finished or has a checkpoint "
        "(its files and checkpoint; a file microsparse did not write is never replaced)",
    )
    add(
        "--capture-gradients",
        metavar="DIR",
        help="save every rank's local flat gradient of the first --capture-steps steps "
        "(loop integration only)",
    )
    add("--capture-steps", type=arguments.positive_int, help="(default: 1)")
    add("--no-progress", action="store_true", help="no progress bar")


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    env = torchrun_env()
    config, saved_workers = _config(args, parser)
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
    device = _resolve_device(args.device, local_workers, parser)
    config = replace(config, device=device)
    writes = env is None or env.rank == 0  # only rank 0 writes
    if writes:
        _check_out(config, args, parser)
    from_file = set(config_from_file(args.config)) - set(_given(args)) if args.config else set()
    data = _check_before_spawning(config, workers, parser, from_file, args.config)
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
    """The resolved config, and the checkpoint's worker count when resuming."""
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
                config = resume_config(meta["config"], given, args.resume)
                return config.resolved(), int(meta["world_size"])
            # The same command line serves the first start and every restart (torchrun
            # --max-restarts): with nothing to resume yet, the run starts in that directory.
            given["out"] = args.resume
        values = config_from_file(args.config) if args.config else {}
        values.update(given)
        task, sparsifier = values.get("task", "mnist"), values.get("sparsifier", "micro")
        if values.get("ddp_hook", "microsparse") != "microsparse":
            sparsifier = values["ddp_hook"]
        values.setdefault("out", f"runs/{task}-{sparsifier}-{time.strftime('%Y%m%d-%H%M%S')}")
        if values.get("capture_gradients"):
            values.setdefault("capture_steps", 1)
        return TrainConfig(**values).resolved(), None
    except ConfigError as error:
        option = _OPTION_OF.get(error.field, "--" + error.field.replace("_", "-"))
        parser.error(f"argument {option}: {error.message}")


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
    for name in ("model_option", "task_option"):
        if getattr(args, name):
            given[name + "s"] = dict(getattr(args, name))
    if args.checkpoint_every == "epoch":
        given.update(checkpoint_every=0, checkpoint_per_epoch=True)
    if args.no_progress:
        given["progress"] = False
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
        names = ("selection", "threshold_rule", "partitioning", "index_message", "density")
        field = next((name for name in names if name in str(error)), "sparsifier")
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


def _per_task(describe: Callable[[Task], str]) -> str:
    parts = [(name, describe(get_task(name))) for name in available_tasks()]
    return "; ".join(f"{name}: {text}" for name, text in parts if text)


def _models(task: Task) -> str:
    return ", ".join(
        f"{name} (default)" if name == task.default_model else name for name in task.models
    )


def _model_options(task: Task) -> str:
    return ", ".join(
        f"{model} {'/'.join(task.model_options(model))}"
        for model in task.models
        if task.model_options(model)
    )


def _task_options(task: Task) -> str:
    return ", ".join(task.options)


def _assignment(text: str) -> tuple[str, Any]:
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)  # numbers, lists, true/false/null
    except json.JSONDecodeError:
        return name, value


def _non_negative(text: str) -> float:
    value = arguments.number(text)
    if not (value >= 0 and value != float("inf")):  # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _epoch_list(text: str) -> tuple[int, ...]:
    return tuple(arguments.non_negative_int(part) for part in text.split(",") if part.strip())


def _checkpoint_every(text: str) -> int | str:
    return "epoch" if text == "epoch" else arguments.positive_int(text)
