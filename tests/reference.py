"""Brute-force, single-process MiCRO (MICRO_SPEC §2 and the reference code), written for clarity.

Deliberately independent of the package: plain Python loops over ranks and positions, numpy
float64, its own partitioning and threshold rule.
"""

from __future__ import annotations

import math

import numpy as np


def reference_partitions(numel: int, n: int) -> list[tuple[int, int]]:
    sizes = [numel // n + (1 if i < numel % n else 0) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    return [(starts[i], starts[i] + sizes[i]) for i in range(n)]


def reference_factor(ratio: float, rule: str) -> float:
    if ratio > 1.1:
        return 1.005
    if ratio > 0.909:
        if rule == "as_coded":
            return 1.00125  # the reference's `if exam > 0:` is always true inside the band
        return 1.00125 if ratio > 1 else 0.9987
    return 0.995


def micro_reference(gradients: list[list[np.ndarray]], density: float, rule: str) -> list[dict]:
    """``gradients[t][r]`` is rank r's flat gradient at step t. Returns one dict per step."""
    n = len(gradients[0])
    numel = len(gradients[0][0])
    target = max(1, math.floor(density * numel))
    threshold = 1.0 / (2.0 * math.sqrt(target))
    partitions = reference_partitions(numel, n)
    residuals = [np.zeros(numel) for _ in range(n)]
    steps = []
    for t, step_gradients in enumerate(gradients):
        accumulated = [residuals[r] + step_gradients[r] for r in range(n)]
        picks = []
        for r in range(n):
            start, end = partitions[(t + r) % n]
            chosen = [i for i in range(start, end) if abs(accumulated[r][i]) >= threshold]
            if not chosen and end > start:
                chosen = [start + t % (end - start)]
            picks.append(chosen)
        union = sorted(i for chosen in picks for i in chosen)
        aggregated = np.zeros(numel)
        for i in union:
            total = 0.0
            for r in range(n):
                total += accumulated[r][i]
            aggregated[i] = total / n
        residuals = []
        for r in range(n):
            residual = accumulated[r].copy()
            residual[union] = 0.0
            residuals.append(residual)
        steps.append(
            {
                "threshold": threshold,
                "picks": picks,
                "selected": len(union),
                "accumulated": accumulated,
                "aggregated": aggregated,
                "residuals": residuals,
            }
        )
        threshold *= reference_factor(len(union) / target, rule)
    return steps
