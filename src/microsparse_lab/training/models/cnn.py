"""The small CNN of the embedded MNIST default, in plain PyTorch (no torchvision)."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Two 5×5 convolutions and two linear layers (about 215 k parameters for 28×28 grey images).

    Example:
        >>> model = SmallCNN()
        >>> model(torch.zeros(8, 1, 28, 28)).shape
        torch.Size([8, 10])
        >>> SmallCNN(classes=100, in_channels=3, image_size=32)(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 100])
    """

    def __init__(
        self,
        classes: int = 10,
        in_channels: int = 1,
        image_size: int = 28,
        width: int = 16,
        hidden: int = 128,
    ) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * side * side, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))
