"""Models of the training tasks, in plain PyTorch (no torchvision)."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Two 5×5 convolutions and two linear layers for 28×28 grey images (about 215 k parameters).

    Example:
        >>> model = SmallCNN()
        >>> model(torch.zeros(8, 1, 28, 28)).shape
        torch.Size([8, 10])
    """

    def __init__(self, classes: int = 10, width: int = 16, hidden: int = 128) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * 7 * 7, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


def build_model(seed: int) -> SmallCNN:
    """A :class:`SmallCNN` whose initial parameters depend only on ``seed``.

    Example:
        >>> a, b = build_model(1), build_model(1)
        >>> all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        True
    """
    # A private generator leaves the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SmallCNN()
