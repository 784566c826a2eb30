"""Brute-force, single-process MiCRO (docs/METHOD.md and the reference code), written for clarity.

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


def reference_owned(numel: int, n: int, partitioning: str) -> list[list[int]]:
    """Positions of each partition, ascending."""
    if partitioning == "contiguous":
        return [list(range(start, end)) for start, end in reference_partitions(numel, n)]
    block = max(1, min(4096, numel // (64 * n)))  # blocks dealt round-robin; the tail is a block
    return [[i for i in range(numel) if (i // block) % n == p] for p in range(n)]


def reference_quantile(magnitudes: list[np.ndarray], previous: float, target: int) -> float:
    """The quantile rule: histogram of log2|a| in 256 bins over ±3 octaves around ``previous``,
    summed over ranks, solved for the count k with power-law interpolation inside the bin."""
    low, high = math.log2(previous) - 3, math.log2(previous) + 3
    bins, width = 256, 6 / 256
    counts = np.zeros(bins)
    for values in magnitudes:
        with np.errstate(divide="ignore"):
            logs = np.clip(np.log2(values), low, high)
        counts += np.histogram(logs, bins=bins, range=(low, high))[0]
    above = [int(counts[j:].sum()) for j in range(bins + 1)]
    if above[bins - 1] >= target:
        return 2.0 ** (high - width)
    if above[1] < target:
        return 2.0**low
    j = max(i for i in range(1, bins) if above[i] >= target)
    upper, lower = above[j], above[j + 1]
    if lower > 0:
        fraction = math.log(upper / target) / math.log(upper / lower)
    else:
        fraction = (upper - target) / upper
    return 2.0 ** (low + (j + fraction) * width)


def micro_reference(
    gradients: list[list[np.ndarray]],
    density: float,
    rule: str,
    partitioning: str = "contiguous",
    capacity_factor: float | None = None,
    momentum: float = 0.0,
    nesterov: bool = False,
    targets: list[int] | None = None,
) -> list[dict]:
    """``gradients[t][r]`` is rank r's flat gradient at step t. Returns one dict per step.

    With ``momentum`` m > 0 (momentum correction): rank r keeps u ← m·u + g, accumulates u
    (Nesterov: g + m·u) instead of g, and zeroes u wherever a value was sent.

    ``targets[t]`` (a density warm-up) is k of step t instead of floor(density · d).

    ``rule="quota"``: at step t the owner of partition p sends its share of the largest |a|
    there (all of it if smaller): share j = (p + t) mod n gets floor((j+1)·k/n) − floor(j·k/n),
    so the shares of one step sum to k; no threshold, no fallback.

    With ``capacity_factor`` (the fixed index message), a rank whose picks exceed
    ceil(capacity_factor · k / n) + 8 sends only that many, the largest |a|.
    """
    n = len(gradients[0])
    numel = len(gradients[0][0])
    target = max(1, math.floor(density * numel))
    threshold = 1.0 / (2.0 * math.sqrt(target))
    owned = reference_owned(numel, n, partitioning)
    residuals = [np.zeros(numel) for _ in range(n)]
    velocities = [np.zeros(numel) for _ in range(n)]
    steps = []
    final_target = target
    for t, step_gradients in enumerate(gradients):
        target = final_target if targets is None else targets[t]
        increments = step_gradients
        if momentum:
            velocities = [momentum * velocities[r] + step_gradients[r] for r in range(n)]
            increments = [
                step_gradients[r] + momentum * velocities[r] if nesterov else velocities[r]
                for r in range(n)
            ]
        accumulated = [residuals[r] + increments[r] for r in range(n)]
        if rule == "quantile":
            mine = [np.abs(accumulated[r][owned[(t + r) % n]]) for r in range(n)]
            threshold = reference_quantile(mine, threshold, target)
        picks = []
        for r in range(n):
            positions = owned[(t + r) % n]
            if rule == "quota":
                by_size = sorted(positions, key=lambda i: -abs(accumulated[r][i]))
                share = ((t + r) % n + t) % n
                quota = (share + 1) * target // n - share * target // n
                picks.append(sorted(by_size[:quota]))
                continue
            chosen = [i for i in positions if abs(accumulated[r][i]) >= threshold]
            if not chosen and positions:
                chosen = [positions[t % len(positions)]]
            if capacity_factor is not None:
                capacity = math.ceil(capacity_factor * target / n) + 8
                largest = sorted(chosen, key=lambda i: -abs(accumulated[r][i]))[:capacity]
                chosen = sorted(largest)
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
            velocities[r] = velocities[r].copy()
            velocities[r][union] = 0.0
        steps.append(
            {
                "threshold": threshold,
                "picks": picks,
                "selected": len(union),
                "accumulated": accumulated,
                "increments": increments,
                "velocities": velocities,
                "aggregated": aggregated,
                "residuals": residuals,
            }
        )
        if rule not in ("quantile", "quota"):
            threshold *= reference_factor(len(union) / target, rule)
    return steps
