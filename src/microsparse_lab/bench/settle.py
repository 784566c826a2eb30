"""Setting a threshold so that a step selects the target count k: one rule for the
simulator's virtual workers (:meth:`~microsparse_lab.bench.virtual.VirtualCluster.settle`) and
the test bed's ranks (:func:`~microsparse_lab.bench.cluster_worker.settle_threshold`).

A threshold each worker keeps for itself over the whole vector is its own k-th largest |a|
(:func:`kth_magnitude`). A λ shared by all workers is found by bisection on the count that all
of them select together (:func:`bisect_threshold`), through the sparsifier's own ``select``, so
that it holds for any partitioning.

Example:
    >>> values = torch.tensor([4.0, -3.0, 2.0, 1.0])
    >>> kth_magnitude(values, 2)
    3.0
    >>> low, high = bisect_threshold(lambda t: int((values.abs() >= t).sum()), 2, 1e-3, 4.0, 60)
    >>> 2.0 < high <= 3.0
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def kth_magnitude(values: torch.Tensor, k: int) -> float:
    """The k-th largest |value| of ``values`` (its smallest when it has fewer than k)."""
    magnitude = values.abs()
    return magnitude.topk(min(k, magnitude.numel())).values[-1].item()


def bisect_threshold(
    count: Callable[[float], int],
    target: int,
    low: float,
    high: float,
    rounds: int,
    within: float | None = None,
) -> tuple[float, float]:
    """Geometric bisection of [``low``, ``high``] for the λ where ``count(λ)`` (how many
    entries λ selects, falling as λ rises) crosses ``target``.

    Keeps count(low) > target ≥ count(high) for ``rounds`` halvings and returns (low, high).
    With ``within``, stops at the first λ with target ≤ count(λ) ≤ ``within``·target and
    returns (λ, λ): where each count costs a collective, a close enough λ is enough.
    """
    for _ in range(rounds):
        middle = math.sqrt(low * high)
        selected = count(middle)
        if within is not None and target <= selected <= within * target:
            return middle, middle
        low, high = (middle, high) if selected > target else (low, middle)
    return low, high
