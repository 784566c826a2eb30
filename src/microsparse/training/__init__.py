"""The harness around the reducer: datasets, models, the per-worker loop and process launching.

Example:
    >>> from microsparse.training import load_mnist, shard_batches
    >>> train, test = load_mnist()
    >>> shard_batches(len(train.labels), batch_size=32, rank=0, world_size=4, seed=1, epoch=0).shape
    torch.Size([31, 32])
"""

from microsparse.training.data import Split, load_mnist, shard_batches
from microsparse.training.launch import WorkerError, launch
from microsparse.training.loop import TrainConfig, train
from microsparse.training.models import SmallCNN, build_model

__all__ = [
    "Split",
    "SmallCNN",
    "TrainConfig",
    "WorkerError",
    "build_model",
    "launch",
    "load_mnist",
    "shard_batches",
    "train",
]
