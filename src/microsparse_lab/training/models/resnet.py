"""CIFAR ResNet-18 and SENet-18 in the usual layout (3×3 stem, no max-pool), plain PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with batch norm and a shortcut (1×1 convolution when shapes change).

    With ``squeeze_excite`` the residual branch is rescaled per channel by a squeeze-and-
    excitation gate (global average pool, 1×1 convolutions ``channels → channels/16 → channels``),
    which makes the block SENet's.
    """

    def __init__(
        self, in_channels: int, channels: int, stride: int, squeeze_excite: bool = False
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )
        self.squeeze_excite = None
        if squeeze_excite:
            self.squeeze_excite = nn.Sequential(
                nn.AdaptiveAvgPool2d(1),
                nn.Conv2d(channels, channels // 16, 1),
                nn.ReLU(),
                nn.Conv2d(channels // 16, channels, 1),
                nn.Sigmoid(),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.squeeze_excite is not None:
            out = out * self.squeeze_excite(out)
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32×32 images: 11,173,962 parameters at 3 channels and 10 classes.

    Any image size of at least 8×8 works (the head pools globally).

    Example:
        >>> model = ResNet18()
        >>> sum(p.numel() for p in model.parameters())
        11173962
        >>> model(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self, classes: int = 10, in_channels: int = 3, squeeze_excite: bool = False
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 3, 1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        stages: list[nn.Module] = []
        channels = 64
        for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages.append(
                nn.Sequential(
                    BasicBlock(channels, width, stride, squeeze_excite),
                    BasicBlock(width, width, 1, squeeze_excite),
                )
            )
            channels = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.linear = nn.Linear(512, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(images)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.linear(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


class SENet18(ResNet18):
    """ResNet-18 with a squeeze-and-excitation gate in every block (11,263,042 parameters).

    Example:
        >>> sum(p.numel() for p in SENet18().parameters())
        11263042
    """

    def __init__(self, classes: int = 10, in_channels: int = 3) -> None:
        super().__init__(classes, in_channels, squeeze_excite=True)
