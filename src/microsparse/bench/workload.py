"""Synthetic inputs shared by the benchmarks: a model-shaped layout and gradients for it."""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import torch

from microsparse.layout import Layout
from microsparse.sparsifiers import (
    Sparsifier,
    available_sparsifiers,
    create_sparsifier,
    method_sparsifiers,
)

RESNET18_NUMEL = 11_173_962
"""Parameters of a CIFAR-10 ResNet-18 (the paper's d)."""
REFERENCE_MICRO = {
    "threshold_rule": "as_coded",
    "partitioning": "contiguous",
    "index_message": "padded",
}
"""Options that make ``micro`` behave like the authors' reference code (those it offers)."""
PARTITIONED = ("padded", "fixed")
"""Exchanges whose ranks select in disjoint partitions: their selection depends on n."""


@dataclass(frozen=True)
class Variant:
    """A sparsifier name with options, and how it is labelled in tables and plots."""

    label: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def create(self, density: float) -> Sparsifier:
        return create_sparsifier(self.name, density, **self.options)


def variants(density: float = 0.001) -> list[Variant]:
    """Every registered sparsifier with its defaults, plus MiCRO as the reference code has it.

    Example:
        >>> [v.label for v in variants()][:2]
        ['cltk', 'deft']
    """
    found = [Variant(name, name) for name in method_sparsifiers()]
    if "micro" in available_sparsifiers():
        offered = inspect.signature(type(create_sparsifier("micro", density)).__init__).parameters
        options = {key: value for key, value in REFERENCE_MICRO.items() if key in offered}
        reference = Variant("micro-reference", "micro", options)
        try:
            if (
                reference.create(density).options()
                != Variant("micro", "micro").create(density).options()
            ):
                found.append(reference)
        except (TypeError, ValueError):  # options not offered by this version of micro
            pass
    return found


def find_variants(labels: tuple[str, ...] | None, density: float = 0.001) -> list[Variant]:
    """The :func:`variants` with these labels (all if None), in that order.

    A label may also give options, ``name(key=value,...)``, e.g.
    ``micro(selection=threshold,partitioning=contiguous)``. Raises ValueError naming unknown
    labels or bad options.

    Example:
        >>> find_variants(("topk", "micro(selection=threshold)"))[1].options
        {'selection': 'threshold'}
    """
    found = {v.label: v for v in variants(density)}
    if labels is None:
        return list(found.values())
    chosen = []
    for label in labels:
        variant = found.get(label) or (parse_variant(label) if "(" in label else None)
        if variant is None:
            raise ValueError(
                f"unknown sparsifier {label!r}; choose from {', '.join(found)}, or give options "
                "as name(key=value,...)"
            )
        try:
            variant.create(density)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{label}: {error}") from None
        chosen.append(variant)
    return chosen


def split_labels(text: str) -> tuple[str, ...]:
    """Comma-separated labels, once each; commas inside ``name(key=value,...)`` stay.

    Example:
        >>> split_labels("topk,micro(selection=threshold,partitioning=contiguous),topk")
        ('topk', 'micro(selection=threshold,partitioning=contiguous)')
    """
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    parts = [part for part in (*parts, current.strip()) if part]
    if not parts or depth:
        raise ValueError(f"expected comma-separated labels, got {text!r}")
    return tuple(dict.fromkeys(parts))


def parse_variant(label: str) -> Variant:
    """``name(key=value,...)`` as a :class:`Variant`; values are JSON where they parse.

    Example:
        >>> parse_variant("micro(capacity_factor=1.5,partitioning=contiguous)").options
        {'capacity_factor': 1.5, 'partitioning': 'contiguous'}
    """
    name, _, rest = label.partition("(")
    if not rest.endswith(")"):
        raise ValueError(f"{label!r}: expected name(key=value,...)")
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest[:-1].split(","))):
        key, equals, value = item.partition("=")
        if not equals:
            raise ValueError(f"{label!r}: option {item!r} is not key=value")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value.strip()
    if "density" in options:  # these benchmarks calibrate their inputs to one density
        raise ValueError(f"{label!r}: density is one per run here: give it with --density")
    return Variant(label, name.strip(), options)


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


def gaussian_scale_for(density: float, threshold: float, excess: float = 1.0) -> float:
    """σ such that N(0, σ²) has a fraction ``excess · density`` of entries with |x| ≥ threshold.

    Example:
        >>> round(gaussian_scale_for(0.05, 1.96), 3)   # 5 % of N(0, 1) lies beyond ±1.96
        1.0
    """
    tail = min(0.999, excess * density)
    return threshold / NormalDist().inv_cdf(1.0 - tail / 2.0)
