"""GoogLeNet for 32×32 images (the CIFAR variant of the paper's benchmarks), plain PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# (1×1, 3×3 reduce, 3×3, 5×5 reduce, 5×5 (as two 3×3), pool projection) of each Inception block
_STAGES = (
    ((64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64)),
    (
        (192, 96, 208, 16, 48, 64),
        (160, 112, 224, 24, 64, 64),
        (128, 128, 256, 24, 64, 64),
        (112, 144, 288, 32, 64, 64),
        (256, 160, 320, 32, 128, 128),
    ),
    ((256, 160, 320, 32, 128, 128), (384, 192, 384, 48, 128, 128)),
)


def _conv(in_channels: int, out_channels: int, size: int) -> list[nn.Module]:
    return [
        nn.Conv2d(in_channels, out_channels, size, padding=size // 2),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
    ]


class Inception(nn.Module):
    """Four parallel branches (1×1; 1×1→3×3; 1×1→3×3→3×3; max-pool→1×1), concatenated."""

    def __init__(
        self, in_channels: int, n1: int, n3_reduce: int, n3: int, n5_reduce: int, n5: int, pool: int
    ) -> None:
        super().__init__()
        self.branch1 = nn.Sequential(*_conv(in_channels, n1, 1))
        self.branch3 = nn.Sequential(*_conv(in_channels, n3_reduce, 1), *_conv(n3_reduce, n3, 3))
        self.branch5 = nn.Sequential(
            *_conv(in_channels, n5_reduce, 1), *_conv(n5_reduce, n5, 3), *_conv(n5, n5, 3)
        )
        self.branch_pool = nn.Sequential(
            nn.MaxPool2d(3, 1, padding=1), *_conv(in_channels, pool, 1)
        )
        self.out_channels = n1 + n3 + n5 + pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branches = (self.branch1, self.branch3, self.branch5, self.branch_pool)
        return torch.cat([branch(x) for branch in branches], dim=1)


class GoogLeNet(nn.Module):
    """GoogLeNet with a 3×3 stem for small images: 6,166,250 parameters at 3 channels, 10 classes.

    Example:
        >>> model = GoogLeNet()
        >>> sum(p.numel() for p in model.parameters())
        6166250
    """

    def __init__(self, classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv(in_channels, 192, 3))
        stages: list[nn.Module] = []
        channels = 192
        for stage in _STAGES:
            blocks = []
            for widths in stage:
                blocks.append(Inception(channels, *widths))
                channels = blocks[-1].out_channels
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.ModuleList(stages)
        self.linear = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out = self.stem(images)
        for index, stage in enumerate(self.stages):
            if index:
                out = F.max_pool2d(out, 3, stride=2, padding=1)
            out = stage(out)
        return self.linear(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
