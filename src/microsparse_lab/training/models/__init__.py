"""Models of the training tasks, in plain PyTorch (no torchvision).

Example:
    >>> from microsparse_lab.training.models import build_resnet18
    >>> sum(p.numel() for p in build_resnet18(num_classes=10, seed=1).parameters())
    11173962
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from microsparse_lab.training.models.cnn import SmallCNN
from microsparse_lab.training.models.googlenet import GoogLeNet
from microsparse_lab.training.models.lstm import LSTMLanguageModel
from microsparse_lab.training.models.neumf import NeuMF
from microsparse_lab.training.models.resnet import ResNet18, SENet18

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def seeded(seed: int, factory: Callable[[], ModuleT]) -> ModuleT:
    """``factory()`` with its parameters initialised from ``seed`` alone.

    A private generator leaves the caller's global RNG state untouched.

    Example:
        >>> a, b = (seeded(1, lambda: nn.Linear(3, 2)) for _ in range(2))
        >>> torch.equal(a.weight, b.weight)
        True
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def build_model(seed: int) -> SmallCNN:
    """The embedded MNIST default: a :class:`SmallCNN` whose initial parameters depend on ``seed``.

    Example:
        >>> a, b = build_model(1), build_model(1)
        >>> all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        True
    """
    return seeded(seed, SmallCNN)


def build_resnet18(num_classes: int = 10, seed: int = 1, in_channels: int = 3) -> ResNet18:
    """The paper's CIFAR ResNet-18 (11,173,962 parameters at 3 channels and 10 classes).

    Example:
        >>> model = build_resnet18(num_classes=100, seed=1)
        >>> model(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 100])
    """
    return seeded(seed, lambda: ResNet18(num_classes, in_channels))


__all__ = [
    "GoogLeNet",
    "LSTMLanguageModel",
    "NeuMF",
    "ResNet18",
    "SENet18",
    "SmallCNN",
    "build_model",
    "build_resnet18",
    "seeded",
]
