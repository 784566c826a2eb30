"""One training run's configuration, and how a task's recipe fills in what was not given."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from microsparse_lab.methods.names import PEERS, parse_method
from microsparse_lab.training.tasks import Recipe, Task, available_tasks, get_task

RECIPE_FIELDS = tuple(f.name for f in fields(Recipe))
VALUE_DTYPES = ("float16", "bfloat16")
"""``value_dtype`` choices: torch dtypes that the sparse values may travel in."""
RESUMABLE_CHANGES = (
    "epochs", "max_steps", "progress", "checkpoint_every", "checkpoint_per_epoch", "timeout",
)  # fmt: skip
"""What may differ from the checkpoint's config when resuming (the rest would not be exact)."""


class ConfigError(ValueError):
    """A config value that cannot work; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field, self.message = field_name, message


@dataclass(frozen=True)
class TrainConfig:
    """One training run, as the ``microsparse train`` options describe it.

    Recipe fields left ``None`` take the task's default (:meth:`resolved`); see
    :class:`microsparse_lab.training.tasks.Recipe` for what each means.
    """

    task: str = "mnist"
    model: str | None = None  # None: the task's default model
    data_dir: str | None = None  # None: the task's embedded data
    model_options: dict[str, Any] = field(default_factory=dict)  # e.g. {"units": 64}
    task_options: dict[str, Any] = field(default_factory=dict)  # e.g. {"bptt": 20}
    sparsifier: str = "micro"
    density: float = 0.001
    threshold_rule: str | None = None  # None: the sparsifier's own default
    selection: str | None = None  # MiCRO's "quota" or "threshold"; None: its own default
    partitioning: str | None = None  # MiCRO's "interleaved" or "contiguous"; None: its own
    index_message: str | None = None  # MiCRO's "fixed" or "padded"; None: its own default
    value_dtype: str | None = None  # "float16" or "bfloat16": the sent values; None: float32
    momentum_correction: bool = False  # the recipe's momentum moves into the error feedback
    # Each worker's Adam step goes into the error feedback. None: on where it applies (an Adam
    # recipe without weight decay or clipping, a sparsifier with error feedback), else off.
    adam_correction: bool | None = None
    density_warmup: tuple[float, float] | None = None  # (start density, epochs)
    # The recipe (None: the task's).
    epochs: int | None = None
    batch_size: int | None = None  # per worker
    optimizer: str | None = None
    lr: float | None = None
    lr_reference_batch: int | None = None
    momentum: float | None = None
    nesterov: bool | None = None
    weight_decay: float | None = None
    warmup_epochs: float | None = None
    decay_epochs: tuple[int, ...] | None = None
    decay_factor: float | None = None
    clip: float | None = None
    betas: tuple[float, float] | None = None
    # The run.
    seed: int = 1  # model initialisation, data order, augmentation; the data split is fixed
    out: str = "runs/train"
    device: str = "cpu"  # "cpu" or "cuda" (one GPU per local rank)
    max_steps: int | None = None  # stop after this many steps (in all), even mid-epoch
    progress: bool = True  # tqdm bar on rank 0
    integration: str = "loop"  # "loop": GradientReducer; "ddp": DistributedDataParallel + hook
    ddp_hook: str = "microsparse"  # or a peer (methods.names): ddp, fp16, bf16, powersgd(...)
    one_exchange: bool = False  # the hook's whole model as one slab, one exchange a step
    min_speedup: float | None = None  # the hook: stay sparse only if X times faster than dense
    checkpoint_every: int = 0  # steps between checkpoints in OUT/checkpoint; 0: none
    checkpoint_per_epoch: bool = False  # also checkpoint after every epoch
    resume: bool = False  # continue from OUT/checkpoint
    timeout: float | None = None  # seconds a collective may wait for a peer; None: torch's
    capture_gradients: str | None = None  # directory for each rank's local gradient per step
    capture_steps: int = 0  # capture steps 0 .. capture_steps - 1

    def sparsifier_options(self) -> dict[str, Any]:
        given = {
            "selection": self.selection,
            "threshold_rule": self.threshold_rule,
            "partitioning": self.partitioning,
            "index_message": self.index_message,
        }
        return {key: value for key, value in given.items() if value is not None}

    @property
    def checkpointing(self) -> bool:
        return self.checkpoint_every > 0 or self.checkpoint_per_epoch

    def resolved(self) -> TrainConfig:
        """This config with the task's model, options and recipe filled in, and checked.

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
        if self.adam_correction is None:
            filled["adam_correction"] = _adam_correction_applies(dataclasses.replace(
                self, **filled))  # fmt: skip
        config = dataclasses.replace(
            self,
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
        _require(self.max_steps is None or _whole(self.max_steps, 1), "max_steps", "must be >= 1")


def _check_integration(config: TrainConfig) -> None:
    """How the gradients are averaged: the loop, DDP's hook, a peer, and their options."""
    _require(config.optimizer in ("sgd", "adam"), "optimizer", "must be sgd or adam")
    _require(config.integration in ("loop", "ddp"), "integration", "must be loop or ddp")
    if config.ddp_hook != "microsparse":
        _check_peer(config)
    microsparse_hook = config.integration == "ddp" and config.ddp_hook == "microsparse"
    only_the_hook = (
        "is an option of microsparse's DDP hook: add --integration ddp (and no --ddp-hook)"
    )
    _require(not config.one_exchange or microsparse_hook, "one_exchange", only_the_hook)
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
