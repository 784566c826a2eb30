"""The registry of training tasks: each knows its data, models, loss, metrics and recipe.

Example:
    >>> from microsparse_lab.training.tasks import available_tasks, get_task
    >>> available_tasks()
    ['cifar10', 'cifar100', 'lm', 'mnist', 'recommendation']
    >>> get_task("lm").metrics[0]
    Metric(name='valid_perplexity', higher_is_better=False)
"""

from __future__ import annotations

from microsparse_lab.training.tasks.base import Epoch, EpochSlice, Metric, Recipe, Task
from microsparse_lab.training.tasks.images import CIFAR10, CIFAR100, MNIST
from microsparse_lab.training.tasks.language import LANGUAGE
from microsparse_lab.training.tasks.recommendation import RECOMMENDATION

_REGISTRY: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Make ``task`` available under ``task.name`` (``--task``); another task may not take a
    name already taken."""
    if _REGISTRY.setdefault(task.name, task) is not task:
        raise ValueError(f"a task named {task.name!r} is already registered")
    return task


def available_tasks() -> list[str]:
    """Names accepted by ``TrainConfig.task`` and ``--task``."""
    return sorted(_REGISTRY)


def get_task(name: str) -> Task:
    """The registered task ``name``; ValueError listing the choices otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"task must be one of {', '.join(available_tasks())}; got {name!r}")
    return _REGISTRY[name]


for _task in (MNIST, CIFAR10, CIFAR100, LANGUAGE, RECOMMENDATION):
    register_task(_task)

__all__ = [
    "Epoch",
    "EpochSlice",
    "Metric",
    "Recipe",
    "Task",
    "available_tasks",
    "get_task",
    "register_task",
]
