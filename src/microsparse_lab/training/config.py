"""One training run's configuration, and how a task's recipe fills in what was not given."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from microsparse.options import SparseOptions
from microsparse.sparsifiers import (
    INDEX_MESSAGES,
    PARTITIONINGS,
    SELECTIONS,
    THRESHOLD_RULES,
    TOPK_WIRES,
    WIRES,
    available_sparsifiers,
)
from microsparse_lab import arguments
from microsparse_lab.arguments import option
from microsparse_lab.methods.names import PEERS, parse_method
from microsparse_lab.training.tasks import Recipe, Task, available_tasks, get_task

RECIPE_FIELDS = tuple(f.name for f in fields(Recipe))
VALUE_DTYPES = SparseOptions.VALUE_DTYPE_NAMES
"""``value_dtype`` choices: torch dtypes that the sparse values may travel in."""
RESUMABLE_CHANGES = (
    "epochs", "max_steps", "progress", "log_every", "checkpoint_every", "checkpoint_per_epoch",
    "timeout",
)  # fmt: skip
"""What may differ from the checkpoint's config when resuming (the rest would not be exact)."""
LOG_EVERY_ON_GPU = 20
"""``log_every``'s default on a GPU: steps between the host's reads of the step's numbers."""


def shards_per_replica(shards: int | None) -> int:
    """The ranks that shard one replica under ``--integration fsdp``: ``--shards``, else
    torchrun's LOCAL_WORLD_SIZE (a machine's ranks), else 1."""
    return shards or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


class ConfigError(ValueError):
    """A config value that cannot work; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field, self.message = field_name, message


def _assignments(flag: str, help: Callable[[], str]) -> Any:
    """A field of named options, given on the command line as ``flag NAME=VALUE``, repeated."""
    return option(
        factory=dict,
        flag=flag,
        action="append",
        type=arguments.assignment,
        metavar="NAME=VALUE",
        help=help,
    )


SPARSIFIER_OPTIONS = ("selection", "threshold_rule", "partitioning", "index_message", "wire")
"""The sparsifier's own options a config carries (None: the sparsifier's default)."""


def option_named_in(message: str) -> str:
    """The option (or ``density``) a sparsifier's error message names, else ``sparsifier``."""
    return next((name for name in (*SPARSIFIER_OPTIONS, "density") if name in message),
                "sparsifier")  # fmt: skip


@dataclass(frozen=True)
class TrainConfig:
    """One training run, as the ``microsparse train`` options describe it: each field
    declares its option (:func:`~microsparse_lab.arguments.option`).

    Recipe fields left ``None`` take the task's default (:meth:`resolved`); see
    :class:`microsparse_lab.training.tasks.Recipe` for what each means.
    """

    task: str = option("mnist", choices=available_tasks, help="(default: %(default)s)")
    model: str | None = option(  # None: the task's default model
        help=lambda: "a model of the task: " + _per_task(_models)
    )
    data_dir: str | None = option(help="real data (default: the task's embedded data)")
    model_options: dict[str, Any] = _assignments(  # e.g. {"units": 64}
        "--model-option",
        lambda: (
            "a model's option (repeatable; value parsed as JSON if it can be): "
            + _per_task(_model_options)
        ),
    )
    task_options: dict[str, Any] = _assignments(  # e.g. {"bptt": 20}
        "--task-option",
        lambda: "a task's option (repeatable): " + _per_task(lambda task: ", ".join(task.options)),
    )
    sparsifier: str = option(
        "micro",
        choices=available_sparsifiers,
        help="how gradient entries are selected (default: %(default)s)",
    )
    density: float | None = option(  # None: what budget (or the default budget) buys
        type=arguments.density,
        help="fraction of gradient entries sent per step, in (0, 1] (default: what 0.2 %% of "
        "dense's bytes buy: 0.0035 for MiCRO on its compact wire up to 16 workers, 0.0024 "
        "beyond, 0.001 on the plain wire)",
    )
    budget: float | None = option(  # a resolved config holds the density it bought too
        type=arguments.budget,
        help="instead of --density: the fraction of dense's bytes (4 per entry) sent per "
        "step, e.g. 0.002; the density follows from the bytes an entry costs on the wire "
        "(8 with int32 indices and float32 values, 6 with --value-dtype; fewer on MiCRO's "
        "compact wire, whose offsets cost less the more are sent)",
    )
    threshold_rule: str | None = option(  # None: the sparsifier's own default
        choices=THRESHOLD_RULES,
        help="MiCRO's shared threshold: quantile, or the paper's per-step corrections "
        "(default: quantile)",
    )
    selection: str | None = option(  # None: MiCRO's own default
        choices=SELECTIONS,
        help="MiCRO's selection: quota (every rank sends k/n entries) or threshold (one "
        "shared threshold) (default: quota, or threshold with --threshold-rule)",
    )
    partitioning: str | None = option(  # None: MiCRO's own default
        choices=tuple(PARTITIONINGS),
        help="MiCRO's partitions: interleaved blocks or the paper's contiguous ranges "
        "(default: interleaved)",
    )
    index_message: str | None = option(  # None: MiCRO's own default
        choices=INDEX_MESSAGES,
        help="MiCRO's index message: fixed (carries its own count) or the paper's padded one "
        "after a count round (default: fixed). The reference code is --threshold-rule as_coded "
        "--partitioning contiguous --index-message padded",
    )
    wire: str | None = option(  # None: the sparsifier's own default
        choices=(*WIRES, *TOPK_WIRES),
        help="MiCRO's wire: plain (4-byte indices), compact (offsets into the owned "
        "partition in Elias-Fano form, about 2 + log2(1/density) bits each, and 8-bit values "
        "up to 16 workers, bfloat16 beyond: about 2.3 or 3.3 bytes an entry instead of 8) or "
        "compact_positions (compact offsets, values as --value-dtype) (default: compact; "
        "plain with a shared threshold or the padded message). Top-k's: union (the paper's, "
        "default) or fixed (n·k slots a step, nothing read back to the host)",
    )
    value_dtype: str | None = option(  # None: float32
        choices=VALUE_DTYPES,
        help="send the selected values in 16 bits (6 bytes an entry with a 4-byte index "
        "instead of 8), or in 8 on MiCRO's compact wire (one byte less an entry; up to "
        "127 ranks); what rounding takes stays in the residual (default: float32, or the "
        "wire's: on the compact wire int8 up to 16 ranks, bfloat16 beyond)",
    )
    momentum_correction: bool = option(
        False,
        action="store_true",
        help="accumulate the recipe's momentum in the error feedback (Deep Gradient "
        "Compression) instead of applying it in the optimiser to the sparse average",
    )
    # None: on where it applies (see _adam_correction_applies), else off.
    adam_correction: bool | None = option(
        action=argparse.BooleanOptionalAction,
        help="with the recipe's Adam: each worker accumulates its own Adam step in the error "
        "feedback, and plain SGD applies the sparse average (default: on for an Adam recipe "
        "without weight decay or --clip and a sparsifier with error feedback, as the "
        "recommendation task's)",
    )
    density_warmup: tuple[float, float] | None = option(  # (start density, epochs)
        type=arguments.density_warmup,
        metavar="START,EPOCHS",
        help="start at density START and decay exponentially to --density over EPOCHS "
        "epochs (the extra traffic counts in the run's mean density)",
    )
    # The recipe (None: the task's).
    epochs: int | None = option(type=arguments.positive_int)
    batch_size: int | None = option(type=arguments.positive_int, help="per worker")
    optimizer: str | None = option(choices=("sgd", "adam"))
    lr: float | None = option(type=arguments.positive_float, help="base learning rate")
    lr_reference_batch: int | None = option(
        type=arguments.non_negative_int,
        help="the lr is scaled by batch size x workers / this (0: not scaled)",
    )
    momentum: float | None = option(type=arguments.momentum, help="SGD momentum, in [0, 1)")
    nesterov: bool | None = option(action=argparse.BooleanOptionalAction)
    weight_decay: float | None = option(
        type=arguments.non_negative_float, help="not applied to batch-norm parameters"
    )
    warmup_epochs: float | None = option(
        type=arguments.non_negative_float, help="linear warm-up from lr / workers"
    )
    decay_epochs: tuple[int, ...] | None = option(
        type=arguments.whole_numbers, help="comma-separated epochs where lr decays"
    )
    decay_factor: float | None = option(type=arguments.positive_float)
    clip: float | None = option(
        type=arguments.non_negative_float, help="max norm of the averaged gradient (0: none)"
    )
    betas: tuple[float, float] | None = None  # a --config file's only
    # The run.
    seed: int = option(
        1,
        type=int,
        help="model initialisation, data order and augmentation; the data split is fixed "
        "(default: %(default)s)",
    )
    out: str = option(
        "runs/train", help="output directory (default runs/TASK-SPARSIFIER-TIMESTAMP)"
    )
    device: str = option(  # "cpu" or "cuda" (one GPU per local rank)
        "cpu",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto picks cuda when available; cuda runs one worker per GPU with NCCL, "
        "cpu uses gloo (default: auto)",
    )
    max_steps: int | None = option(  # even mid-epoch
        type=arguments.positive_int, help="stop after this many steps in all"
    )
    progress: bool = option(  # tqdm bar on rank 0
        True, flag="--no-progress", action="store_false", help="no progress bar"
    )
    log_every: int | None = option(  # None: 1 on the CPU, LOG_EVERY_ON_GPU on a GPU
        type=arguments.positive_int,
        metavar="N",
        help="read each step's loss, statistics and times on the host every N steps (each "
        "step is still recorded): on a GPU a read makes the host wait for the device "
        f"(default: 1 on the CPU, where nothing waits, {LOG_EVERY_ON_GPU} on a GPU)",
    )
    integration: str = option(
        "loop",
        choices=("loop", "ddp", "fsdp"),
        help="loop: GradientReducer.synchronize() after backward; ddp: DistributedDataParallel "
        "with the sparse comm hook (the same step, overlapped with backward); fsdp: the model "
        "sharded by FSDP2 over --shards ranks per replica, the replicas averaging sparsely "
        "(microsparse.fsdp; with --sparsifier dense, FSDP2's own hybrid sharding) "
        "(default: %(default)s)",
    )
    shards: int | None = option(
        type=arguments.positive_int,
        metavar="N",
        help="with --integration fsdp: ranks that shard one replica of the model (the ranks "
        "of one machine, say); the world size must be a multiple (default: the ranks per "
        "machine, torchrun's LOCAL_WORLD_SIZE)",
    )
    ddp_hook: str = option(  # or a peer (methods.names)
        "microsparse",
        metavar="HOOK",
        help="with --integration ddp: microsparse (the sparse hook, --sparsifier), or what "
        "users would pick instead, for comparison: ddp (stock DDP), fp16, bf16 (torch's "
        "compression hooks), powersgd(rank=R,start=S) (torch's powerSGD_hook with one bucket "
        "holding the whole model, plain all-reduce for S steps (default 2), then compressed); "
        "--sparsifier and --density are then unused (default: %(default)s)",
    )
    one_exchange: bool = option(
        False,
        action="store_true",
        help="with --integration ddp or fsdp: average the whole model in one exchange after "
        "backward, instead of one exchange per DDP bucket or FSDP module (fewer collective "
        "rounds, no overlap with backward)",
    )
    min_speedup: float | None = option(
        type=arguments.positive_float,
        metavar="X",
        help="with --integration ddp: time a few steps sparse and dense, then stay sparse only "
        "if its step is at least X times faster, else average densely as DDP does (default: "
        "always sparse)",
    )
    checkpoint_every: int = option(  # steps between checkpoints in OUT/checkpoint; 0: none
        0,
        type=arguments.steps_or_epoch,
        metavar="N|epoch",
        help="checkpoint into OUT/checkpoint every N steps, or after every epoch (and at the end)",
    )
    checkpoint_per_epoch: bool = False  # also checkpoint after every epoch
    resume: bool = False  # continue from OUT/checkpoint
    timeout: float | None = option(  # None: torch's
        type=arguments.positive_float,
        metavar="SECONDS",
        help="end the job when a peer has not joined a collective for this long (stopped, "
        "hung or gone) (default: torch's, 30 minutes)",
    )
    capture_gradients: str | None = option(  # each rank's local gradient per step
        metavar="DIR",
        help="save every rank's local flat gradient of the first --capture-steps steps "
        "(loop integration only)",
    )
    capture_steps: int = option(  # capture steps 0 .. capture_steps - 1
        0, type=arguments.positive_int, help="(default: 1)"
    )

    def _priced(self, ranks: int | None) -> tuple[float, str | None]:
        """``density``, or the density ``budget`` (or, given neither, the default budget)
        buys on this run's wire among ``ranks`` averaging ranks (None: not known yet); and
        ``value_dtype``, or, where the ranks are known, the wire's choice for them by name
        (so that a checkpoint records what was sent, whatever a later default); the
        library's own checks of the options first. Like a bought density, the choice is
        then the config's: resolve a config for the ranks that will run it."""
        given = self.density if self.budget is None else None
        # A value dtype that is no name of one, or given to a peer, is check()'s to name.
        named = self.value_dtype in VALUE_DTYPES and self.ddp_hook == "microsparse"
        dtype = SparseOptions.value_dtype_named(self.value_dtype) if named else None
        try:
            options = SparseOptions(self.sparsifier, given, value_dtype=dtype, budget=self.budget,
                                    options=self.sparsifier_options(), ranks=ranks)  # fmt: skip
        except (TypeError, ValueError) as error:  # the budget's, or the options' own error
            message = str(error)
            field = ("value_dtype" if message.startswith("value_dtype")
                     else "budget" if self.budget is not None else option_named_in(message))
            raise ConfigError(field, message) from None
        values = self.value_dtype
        if values is None and ranks is not None and self.ddp_hook == "microsparse":
            chosen = options.wire_value_dtype(ranks)
            values = None if chosen is None else str(chosen).removeprefix("torch.")
        if given is not None:
            return given, values
        # a resolved config (a resumed run's) holds the density its budget bought
        if self.density is not None and self.density != options.density:
            raise ConfigError(
                "budget",
                f"give --density or --budget, not both (got density {self.density:g}, budget "
                f"{self.budget:g}): the budget sets the density; leave --density out",
            )
        return options.density, values

    def averaging_ranks(self, world_size: int) -> int:
        """The ranks among ``world_size`` that average gradients: every one, or with
        ``--integration fsdp`` one a replica (``shards`` ranks each, by default torchrun's
        LOCAL_WORLD_SIZE, else 1: the mesh ``training.sharding.mesh_of`` builds).

        Example:
            >>> TrainConfig(integration="fsdp", shards=4).averaging_ranks(32)
            8
        """
        if self.integration != "fsdp":
            return world_size
        shards = shards_per_replica(self.shards)
        return world_size // shards if world_size % shards == 0 else world_size

    def sparsifier_options(self) -> dict[str, Any]:
        given = {name: getattr(self, name) for name in SPARSIFIER_OPTIONS}
        return {key: value for key, value in given.items() if value is not None}

    @property
    def checkpointing(self) -> bool:
        return self.checkpoint_every > 0 or self.checkpoint_per_epoch

    def resolved(self, ranks: int | None = None) -> TrainConfig:
        """This config with the task's model, options and recipe filled in, and checked;
        the density a budget buys priced for ``ranks`` averaging ranks, where known (MiCRO's
        values travel as int8 up to 16 ranks, bfloat16 beyond).

        Raises ConfigError naming the field (and the choices, for an unknown task, model or
        option).

        Example:
            >>> TrainConfig(task="lm").resolved().model, TrainConfig(task="lm").resolved().clip
            ('lstm-small', 0.4)
        """
        if self.task not in available_tasks():
            raise ConfigError(
                "task", f"must be one of {', '.join(available_tasks())}; got {self.task!r}"
            )
        task = get_task(self.task)
        model = self.model or task.default_model
        if model not in task.models:
            raise ConfigError(
                "model",
                f"must be one of {', '.join(task.models)} for task {task.name}; got {model!r}",
            )
        recipe = task.recipe(self.data_dir)
        filled = {
            name: getattr(recipe, name) for name in RECIPE_FIELDS if getattr(self, name) is None
        }
        if self.decay_epochs is not None:
            filled["decay_epochs"] = tuple(self.decay_epochs)
        if self.betas is not None:
            filled["betas"] = tuple(self.betas)
        if self.log_every is None:
            filled["log_every"] = LOG_EVERY_ON_GPU if self.device == "cuda" else 1
        if self.adam_correction is None:
            filled["adam_correction"] = _adam_correction_applies(dataclasses.replace(
                self, **filled))  # fmt: skip
        density, value_dtype = self._priced(ranks)
        config = dataclasses.replace(
            self,
            density=density,
            value_dtype=value_dtype,
            model=model,
            model_options=_options("model_options", task.model_options(model), self.model_options),
            task_options=_options("task_options", task.options, self.task_options),
            **filled,
        )
        config.check(task)
        return config

    def check(self, task: Task) -> None:
        """Raise ConfigError naming the first field whose value cannot work."""
        _check_integration(self)
        _check_recipe(self)
        _check_sparse_options(self)
        _require(_whole(self.checkpoint_every, 0), "checkpoint_every", "must be >= 0")
        _require(self.log_every is None or _whole(self.log_every, 1), "log_every", "must be >= 1")
        _require(self.max_steps is None or _whole(self.max_steps, 1), "max_steps", "must be >= 1")


def _check_integration(config: TrainConfig) -> None:
    """How the gradients are averaged: the loop, DDP's hook, a peer, and their options."""
    _require(config.optimizer in ("sgd", "adam"), "optimizer", "must be sgd or adam")
    _require(config.integration in ("loop", "ddp", "fsdp"), "integration",
             "must be loop, ddp or fsdp")  # fmt: skip
    _check_sharding(config)
    if config.ddp_hook != "microsparse":
        _check_peer(config)
    microsparse_hook = config.integration == "ddp" and config.ddp_hook == "microsparse"
    only_the_hook = (
        "is an option of microsparse's DDP hook: add --integration ddp (and no --ddp-hook)"
    )
    sparse_fsdp = config.integration == "fsdp" and config.sparsifier != "dense"
    _require(
        not config.one_exchange or microsparse_hook or sparse_fsdp,
        "one_exchange",
        "is an option of microsparse's DDP hook (--integration ddp, no --ddp-hook) and of "
        "its sparse FSDP averaging (--integration fsdp, a sparsifier other than dense)",
    )
    if config.min_speedup is not None:
        _require(microsparse_hook, "min_speedup", only_the_hook)
        _require(_number(config.min_speedup, low=0, open_low=True), "min_speedup",
                 "must be a finite number > 0")  # fmt: skip
        _require(
            config.sparsifier != "dense" and config.density < 1,
            "min_speedup",
            "chooses between sparse and dense averaging: it needs a sparsifier that "
            "selects (not dense, density below 1)",
        )
        for clash, undo in (
            ("momentum_correction", "drop --momentum-correction"),
            ("adam_correction", "add --no-adam-correction"),
        ):
            _require(not getattr(config, clash), "min_speedup",
                     f"may average some steps densely, which {clash} does not support: "
                     f"drop --min-speedup, or {undo}")  # fmt: skip
    _require(
        not (config.capture_gradients and config.integration != "loop"),
        "capture_gradients",
        "needs integration loop (the DDP hook averages gradients during backward)",
    )


def _check_sharding(config: TrainConfig) -> None:
    """What an FSDP2 run takes (its checkpoints record the mesh: a resumed run on another
    is refused by the loop, naming the --shards to resume with)."""
    fsdp = config.integration == "fsdp"
    _require(config.shards is None or fsdp, "shards", "is an option of --integration fsdp")
    _require(config.shards is None or _whole(config.shards, 1), "shards", "must be >= 1")


def _check_recipe(config: TrainConfig) -> None:
    """The optimiser's and the schedule's numbers."""
    for name in ("epochs", "batch_size"):
        _require(_whole(getattr(config, name), 1), name, "must be a whole number >= 1")
    _require(_whole(config.lr_reference_batch, 0), "lr_reference_batch", "must be >= 0")
    _require(_number(config.lr, low=0, open_low=True), "lr", "must be a finite number > 0")
    _require(_number(config.momentum, 0, 1), "momentum", "must be in [0, 1)")
    for name in ("weight_decay", "warmup_epochs", "clip"):
        _require(_number(getattr(config, name), 0), name, "must be a finite number >= 0")
    _require(_number(config.decay_factor, 0, open_low=True), "decay_factor", "must be > 0")
    _require(
        all(_whole(epoch, 0) for epoch in config.decay_epochs),
        "decay_epochs",
        "must be whole numbers >= 0",
    )
    _require(
        len(config.betas) == 2 and all(_number(beta, 0, 1) for beta in config.betas),
        "betas",
        "must be two numbers in [0, 1)",
    )


def _check_sparse_options(config: TrainConfig) -> None:
    """The options of a sparsifier with error feedback, and what each needs of the recipe."""

    def require_sparse(name: str, what: str) -> None:
        _require(config.sparsifier != "dense" and config.ddp_hook == "microsparse", name,
                 f"{what} (not dense, not a --ddp-hook peer)")  # fmt: skip

    if config.momentum_correction:
        _require(
            config.optimizer == "sgd" and bool(config.momentum),
            "momentum_correction",
            "moves SGD's momentum into the error feedback: it needs optimizer sgd with "
            "momentum > 0",
        )
        require_sparse("momentum_correction", "needs a sparsifier with error feedback")
    if config.value_dtype is not None:
        _require(
            config.value_dtype in VALUE_DTYPES,
            "value_dtype",
            f"must be one of {', '.join(VALUE_DTYPES)}; got {config.value_dtype!r}",
        )
        require_sparse("value_dtype", "narrows the values a sparsifier sends")
    if config.adam_correction:
        _require(
            config.optimizer == "adam" and not config.weight_decay,
            "adam_correction",
            "moves Adam into the error feedback: it needs optimizer adam without weight decay",
        )
        _require(
            not config.clip,
            "adam_correction",
            "the averaged values are Adam steps, and --clip would cap their norm instead of "
            "the gradients': train with --clip 0",
        )
        require_sparse("adam_correction", "needs a sparsifier with error feedback")
    if config.density_warmup is not None:
        warmup = config.density_warmup
        _require(
            isinstance(warmup, (list, tuple))
            and len(warmup) == 2
            and _number(warmup[0], config.density, math.nextafter(1.0, 2.0), open_low=True)
            and _number(warmup[1], 0, open_low=True),
            "density_warmup",
            f"must be START,EPOCHS with density ({config.density:g}) < START <= 1 and "
            "EPOCHS > 0, e.g. 0.01,0.5",
        )
        require_sparse("density_warmup", "needs a sparsifier that selects")


def _adam_correction_applies(config: TrainConfig) -> bool:
    """Adam correction's default: on for an Adam recipe it can run (no weight decay, no
    clipping) with a sparsifier that keeps error feedback. The study in
    docs/results/runs/2026-12-01_quality-d0001.md measured it on the one Adam task (NeuMF:
    22.8 points of hit ratio behind dense without it, 6.9 with it)."""
    return (
        config.optimizer == "adam"
        and not config.weight_decay
        and not config.clip
        and config.sparsifier != "dense"
        and config.ddp_hook == "microsparse"
    )


def _check_peer(config: TrainConfig) -> None:
    choices = f"microsparse, {', '.join(PEERS)} or powersgd(rank=R,start=S)"
    unknown = f"must be one of {choices}; got {config.ddp_hook!r}"
    try:
        method = parse_method(config.ddp_hook)
    except ValueError as error:
        known = config.ddp_hook.partition("(")[0].partition("@")[0] in PEERS
        raise ConfigError("ddp_hook", str(error) if known else unknown) from None
    _require(method.kind == "peer", "ddp_hook", unknown)
    _require(
        config.integration == "ddp",
        "ddp_hook",
        f"{config.ddp_hook} trains through DistributedDataParallel: add --integration ddp",
    )
    _require(
        not (method.sparsifier == "powersgd" and not method.one_bucket and config.device != "cuda"),
        "ddp_hook",
        "torch's powerSGD_hook with DDP's buckets can hang on gloo (each bucket's all-reduces "
        "are chained on gloo's threads and ranks may issue them in different orders); use "
        "powersgd, which gives it one bucket",
    )


def config_from_file(path: str | Path) -> dict[str, Any]:
    """The fields set in a JSON config file (an object whose keys are ``TrainConfig`` fields).

    Example:
        >>> Path("/tmp/ms-doctest.json").write_text('{"task": "lm", "lr": 5}')
        23
        >>> config_from_file("/tmp/ms-doctest.json")
        {'task': 'lm', 'lr': 5}
    """
    try:
        values = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError("config", f"cannot read {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ConfigError("config", f"{path} is not valid JSON: {error}") from None
    if not isinstance(values, dict):
        raise ConfigError("config", f"{path} must hold a JSON object of option names and values")
    known = {f.name for f in fields(TrainConfig)} - {"resume", "out"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            "config",
            f"{path}: unknown key {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(known))}",
        )
    return values


def resume_config(saved: dict[str, Any], changes: dict[str, Any], out: str) -> TrainConfig:
    """The config of a resumed run: ``saved`` (a checkpoint's), with only allowed ``changes``.

    Raises ConfigError naming a field that may not change (the run would not continue
    exactly).
    """
    for name, value in changes.items():
        if name not in RESUMABLE_CHANGES and _json(value) != _json(saved.get(name)):
            raise ConfigError(
                name,
                f"cannot change when resuming (the checkpoint has {saved.get(name)!r}); "
                f"only {', '.join(RESUMABLE_CHANGES)} may change",
            )
    known = {f.name for f in fields(TrainConfig)}
    values = {name: value for name, value in saved.items() if name in known}
    values.update(changes, out=out, resume=True)  # the saved max_steps too, unless changed
    return TrainConfig(**values)


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value))  # tuples and lists compare equal


def _options(what: str, defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        accepted = ", ".join(defaults) or "none"
        raise ConfigError(what, f"unknown {', '.join(map(repr, unknown))}; accepted: {accepted}")
    return {**defaults, **given}


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(name, message)


def _whole(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _number(value: Any, low: float, high: float = math.inf, open_low: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and (value > low if open_low else value >= low) and value < high


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
