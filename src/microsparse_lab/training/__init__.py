"""The harness around the reducer: tasks (data, models, metrics, recipes), the per-worker loop,
checkpoints, gradient capture and process launching.

Example:
    >>> from microsparse_lab.training import build_resnet18, load_mnist, shard_batches
    >>> train, test = load_mnist()
    >>> shard_batches(len(train.labels), batch_size=32, rank=0, world_size=4, seed=1, epoch=0).shape
    torch.Size([31, 32])
    >>> sum(p.numel() for p in build_resnet18(num_classes=10, seed=1).parameters())
    11173962
"""

from microsparse_lab.training.capture import GradientCapture, flat_gradient
from microsparse_lab.training.config import TrainConfig
from microsparse_lab.training.data import Split, load_mnist, shard_batches
from microsparse_lab.training.launch import WorkerError, launch
from microsparse_lab.training.loop import train
from microsparse_lab.training.models import SmallCNN, build_model, build_resnet18
from microsparse_lab.training.tasks import available_tasks, get_task

__all__ = [
    "GradientCapture",
    "Split",
    "SmallCNN",
    "TrainConfig",
    "WorkerError",
    "available_tasks",
    "build_model",
    "build_resnet18",
    "flat_gradient",
    "get_task",
    "launch",
    "load_mnist",
    "shard_batches",
    "train",
]
