"""What a training task is: data, models, loss per step, evaluation metrics and a recipe."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from microsparse_lab.reports.runs import Metric


@dataclass(frozen=True)
class Recipe:
    """A task's training hyper-parameters; every field is also a ``TrainConfig`` option."""

    epochs: int
    batch_size: int  # per worker
    optimizer: str  # "sgd" or "adam"
    lr: float  # base learning rate, scaled by batch_size · workers / lr_reference_batch
    lr_reference_batch: int = 0  # 0: the learning rate is not scaled
    momentum: float = 0.0  # SGD momentum
    nesterov: bool = False
    weight_decay: float = 0.0  # L2, never applied to batch-norm parameters
    warmup_epochs: float = 0.0  # linear ramp from lr / workers to lr
    decay_epochs: tuple[int, ...] = ()  # multiply the learning rate by decay_factor at these
    decay_factor: float = 0.1
    clip: float = 0.0  # max L2 norm of the averaged gradient; 0: no clipping
    betas: tuple[float, float] = (0.9, 0.999)  # Adam


@dataclass(frozen=True)
class EpochSlice:
    """The part of one epoch a rank trains on: rank ``rank`` of ``world_size``,
    ``batch_size`` examples a step, the order fixed by ``seed`` and ``epoch``, the batches
    moved to ``device``."""

    epoch: int
    rank: int
    world_size: int
    batch_size: int
    seed: int
    device: torch.device


class Epoch(ABC):
    """One epoch of this rank's training batches; :meth:`loss` must be called in step order."""

    steps: int

    @abstractmethod
    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        """The training loss of batch ``step`` (0 ≤ step < steps) under ``model``."""

    def state_dict(self) -> dict[str, Any]:
        """What the epoch carries from one step to the next (e.g. an LSTM's hidden state)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` before resuming in the middle of the epoch."""


ModelBuilder = Callable[..., nn.Module]
"""``builder(data, **options)`` makes a model for a task's loaded data."""


class Task(ABC):
    """A workload: data (embedded default or ``data_dir``), models, loss, metrics, recipe.

    ``metrics[0]`` is the headline metric. Subclasses set the class attributes and implement
    the four methods; the training loop knows nothing else about them.
    """

    name: str
    description: str
    models: dict[str, ModelBuilder]
    default_model: str
    metrics: tuple[Metric, ...]
    options: dict[str, Any] = {}
    """Task options (``--task-option NAME=VALUE``) and their defaults."""

    @abstractmethod
    def load(self, data_dir: str | None, options: dict[str, Any]) -> Any:
        """The task's data: embedded if ``data_dir`` is None, else read from it."""

    def check_data_dir(self, data_dir: str | None) -> None:
        """Raise MissingDataError naming the first missing file (cheap: no reading)."""

    @abstractmethod
    def recipe(self, data_dir: str | None) -> Recipe:
        """Default hyper-parameters: the paper's for real data, a short one for embedded data."""

    @abstractmethod
    def steps_per_epoch(
        self, data: Any, options: dict[str, Any], world_size: int, batch_size: int
    ) -> int:
        """Steps of every epoch (0 if one global batch is more than the training data)."""

    @abstractmethod
    def epoch(self, data: Any, options: dict[str, Any], part: EpochSlice) -> Epoch:
        """This rank's batches of one epoch; the same number of steps on every rank."""

    @abstractmethod
    def evaluate(self, model: nn.Module, data: Any, options: dict[str, Any]) -> dict[str, float]:
        """Every metric of ``metrics`` (and optionally a loss) of ``model``, in eval mode."""

    def build_model(self, name: str, data: Any, seed: int, options: dict[str, Any]) -> nn.Module:
        """Model ``name`` for ``data``, its initial parameters fixed by ``seed`` alone."""
        builder = self.models[name]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return builder(data, **options)

    def model_options(self, name: str) -> dict[str, Any]:
        """The options ``--model-option`` accepts for model ``name``, with their defaults."""
        parameters = list(inspect.signature(self.models[name]).parameters.values())[1:]
        return {p.name: p.default for p in parameters}
