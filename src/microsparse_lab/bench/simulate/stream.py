"""The simulator's gradient stream (:class:`~microsparse_lab.bench.streams.Stream`): s_t the
captured ranks' mean gradient, cycled, or a synthetic draw; ρ given, or estimated from the
spread between the captured ranks."""

from __future__ import annotations

import math
import statistics

import torch

from microsparse_lab.bench.capture import CapturedGradients, load_capture
from microsparse_lab.bench.simulate.config import DEFAULT_NOISE_RATIO, SimulateConfig
from microsparse_lab.bench.streams import Stream
from microsparse_lab.bench.workload import model_layout, synthetic_gradient


def simulated_stream(config: SimulateConfig) -> Stream:
    """The stream of the module docstring: s_t the captured ranks' mean (cycled) or a
    synthetic draw, ρ given, estimated from the captured ranks, or 1.0."""
    estimated: float | None = None
    if config.capture:
        capture = load_capture(config.capture)
        layout, name = capture.layout, "captured"
        if len(capture.ranks) > 1:
            estimated = estimate_noise_ratio(capture)
        cache: dict[int, torch.Tensor] = {}

        def shared(step: int, generator: torch.Generator) -> torch.Tensor:
            index = step % capture.steps
            if index not in cache:
                cache[index] = capture.mean_gradient(index)
            return cache[index]

        meta = capture.metadata
        source = (
            f"captured gradients of {meta.get('task', '?')}/{meta.get('model', '?')} "
            f"({len(capture.ranks)} ranks × {capture.steps} steps, mean over "
            f"ranks), d = {layout.numel:,}"
        )
    else:
        layout, name = model_layout(config.numel), "synthetic"

        def shared(step: int, generator: torch.Generator) -> torch.Tensor:
            return synthetic_gradient(layout, generator)

        source = f"synthetic Gaussian with per-layer scales, d = {layout.numel:,}"
    ratio = config.noise_ratio
    if ratio is None:
        ratio = estimated if estimated is not None else DEFAULT_NOISE_RATIO
    how = "given"
    if estimated is not None and ratio == estimated:
        how = "estimated from the captured ranks"
    description = f"{source}; noise ρ = {ratio:.3g} ({how})"
    return Stream(name, layout, shared, description, noise_ratio=ratio)


def estimate_noise_ratio(capture: CapturedGradients, steps: int = 20) -> float:
    """ρ from the captured ranks: median over steps of ‖g_r − ḡ‖·sqrt(m/(m−1)) / ‖ḡ‖.

    Each of the m captured ranks computed its gradient on its own mini-batch, so their
    spread around the mean is the mini-batch noise (the mean itself carries 1/√m of it).
    """
    ratios = []
    m = len(capture.ranks)
    for step in range(min(steps, capture.steps)):
        gradients = torch.stack([capture.gradient(rank, step) for rank in capture.ranks]).double()
        mean = gradients.mean(dim=0)
        spread = (gradients - mean).square().sum(dim=1).mean().sqrt() * math.sqrt(m / (m - 1))
        norm = mean.norm()
        if norm > 0:
            ratios.append((spread / norm).item())
    return statistics.median(ratios) if ratios else DEFAULT_NOISE_RATIO
