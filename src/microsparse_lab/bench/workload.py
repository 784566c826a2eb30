"""Synthetic inputs shared by the benchmarks: a model-shaped layout and gradients for it."""

from __future__ import annotations

import math

import torch

from microsparse.layout import Layout

RESNET18_NUMEL = 11_173_962
"""Parameters of a CIFAR-10 ResNet-18 (the paper's d)."""
PARTITIONED = ("padded", "fixed")
"""Exchanges whose ranks select in disjoint partitions: their selection depends on n."""


def resnet18_sizes(classes: int = 10) -> list[tuple[str, int]]:
    """Parameter sizes of a CIFAR ResNet-18 in ``named_parameters()`` order.

    Example:
        >>> sizes = resnet18_sizes()
        >>> len(sizes), sum(size for _, size in sizes)
        (62, 11173962)
    """
    sizes = [("conv1.weight", 64 * 3 * 9), ("bn1.weight", 64), ("bn1.bias", 64)]
    width = 64
    for stage, out in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            inner = width if block == 0 else out
            name = f"layer{stage}.{block}"
            sizes += [
                (f"{name}.conv1.weight", out * inner * 9),
                (f"{name}.bn1.weight", out),
                (f"{name}.bn1.bias", out),
                (f"{name}.conv2.weight", out * out * 9),
                (f"{name}.bn2.weight", out),
                (f"{name}.bn2.bias", out),
            ]
            if inner != out:
                sizes += [
                    (f"{name}.shortcut.0.weight", out * inner),
                    (f"{name}.shortcut.1.weight", out),
                    (f"{name}.shortcut.1.bias", out),
                ]
        width = out
    return sizes + [("linear.weight", classes * 512), ("linear.bias", classes)]


def model_layout(numel: int) -> Layout:
    """ResNet-18's parameter sizes scaled to ``numel`` entries in all (exact at 11,173,962).

    Each parameter keeps at least one entry; the largest absorbs the rounding.

    Example:
        >>> model_layout(RESNET18_NUMEL).numel, len(model_layout(1000).names)
        (11173962, 62)
    """
    named = resnet18_sizes()
    if numel < len(named):
        raise ValueError(f"numel must be at least {len(named)}, got {numel}")
    sizes = [max(1, round(size * numel / RESNET18_NUMEL)) for _, size in named]
    largest = sizes.index(max(sizes))
    sizes[largest] += numel - sum(sizes)
    return Layout(
        tuple(name for name, _ in named),
        tuple(torch.Size([size]) for size in sizes),
        tuple(_offsets(sizes)),
        numel,
    )


def layout_from_sizes(sizes: list[int]) -> Layout:
    """A layout of 1-D parameters ``p0, p1, …`` of the given sizes."""
    return Layout(
        tuple(f"p{i}" for i in range(len(sizes))),
        tuple(torch.Size([size]) for size in sizes),
        tuple(_offsets(sizes)),
        sum(sizes),
    )


def _offsets(sizes: list[int]) -> list[int]:
    offsets, offset = [], 0
    for size in sizes:
        offsets.append(offset)
        offset += size
    return offsets


def layer_scales(layout: Layout, spread: float = 4.0, seed: int = 0) -> torch.Tensor:
    """One gradient scale per parameter, log-uniform in [1/spread, spread] (fixed seed).

    Real layers differ in gradient magnitude; this is what makes contiguous partitions
    unbalanced.
    """
    generator = torch.Generator().manual_seed(seed)
    exponents = torch.rand(len(layout.names), generator=generator, dtype=torch.float64) * 2 - 1
    return torch.pow(spread, exponents).float()


def expand(
    per_layer: torch.Tensor, layout: Layout, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A flat vector holding ``per_layer[i]`` at every position of parameter i."""
    counts = torch.tensor(layout.sizes, device=device)
    return torch.repeat_interleave(per_layer.to(device), counts)


def layer_rms(vector: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Root-mean-square of ``vector`` over each parameter of ``layout``.

    Example:
        >>> layer_rms(torch.tensor([3.0, -3.0, 1.0]), layout_from_sizes([2, 1])).tolist()
        [3.0, 1.0]
    """
    return torch.stack(
        [piece.double().square().mean().sqrt() for piece in vector.split(list(layout.sizes))]
    ).float()


def synthetic_gradient(
    layout: Layout, generator: torch.Generator, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Gaussian entries with per-layer scales from :func:`layer_scales`."""
    values = torch.randn(layout.numel, generator=generator, device=device)
    return values.mul_(expand(layer_scales(layout), layout, device))


def quantile_of_magnitude(vector: torch.Tensor, fraction: float, sample: int = 1 << 20) -> float:
    """Estimate of the ``fraction`` quantile of |vector| from at most ``sample`` entries.

    (``torch.quantile`` refuses more than 2**24 elements, and a sample is enough here.)
    """
    if vector.numel() > sample:
        step = vector.numel() // sample
        vector = vector[::step]
    magnitudes = vector.abs().float()
    index = min(magnitudes.numel(), max(1, math.ceil(fraction * magnitudes.numel())))
    return magnitudes.kthvalue(index).values.item()


def calibrate(vector: torch.Tensor, density: float, threshold: float) -> torch.Tensor:
    """Scale ``vector`` in place so that ``|x| >= threshold`` holds for about ``density`` of it.

    Threshold sparsifiers start from λ_0 = 1/(2·sqrt(k)); a vector calibrated to it makes them
    select about k entries from the first step, as they would once their threshold settled.
    """
    current = quantile_of_magnitude(vector, 1.0 - density)
    return vector.mul_(threshold / current) if current > 0 else vector
