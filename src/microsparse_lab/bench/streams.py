"""A gradient stream: the component every worker shares at each step, and each worker's noise.

Worker r's gradient at step t is

    g_{r,t} = s_t + ρ · rms_layer(s_t) · z_{r,t},   z ~ N(0, 1) independent per worker and step,

where s_t is the stream's shared component (:attr:`Stream.shared`: a synthetic draw, a
captured gradient, ...) and rms_layer(s_t) is the root-mean-square of s_t over the parameter
holding each entry (:func:`with_noise`). ``microsparse simulate`` and ``microsparse bench
controller`` build their streams from this one model.

Example:
    >>> from microsparse_lab.bench.workload import model_layout
    >>> layout = model_layout(1_000)
    >>> stream = Stream("ones", layout, lambda step, generator: torch.ones(1_000), "all ones",
    ...                 steps=2, noise_ratio=0.0)
    >>> source = stream.source(0, torch.Generator().manual_seed(0))
    >>> bool(source(0, torch.empty(1_000)).eq(1).all())
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from microsparse.layout import Layout
from microsparse_lab.bench.virtual import GradientSource
from microsparse_lab.bench.workload import expand, layer_rms


def with_noise(
    shared: torch.Tensor, layout: Layout, ratio: float, generator: torch.Generator
) -> GradientSource:
    """Worker r's gradient: ``shared`` + ratio · rms_layer(shared) · z, fresh z per call."""
    scale = expand(ratio * layer_rms(shared, layout), layout)

    def gradient_for(rank: int, out: torch.Tensor) -> torch.Tensor:
        torch.randn(out.shape, generator=generator, out=out)
        return out.mul_(scale).add_(shared)

    return gradient_for


@dataclass(frozen=True)
class Stream:
    """A named gradient stream over one layout.

    ``shared(step, generator)`` is s_t; a random stream draws it from ``generator``, so one
    run asks for its steps in order from one generator. ``steps``: how many steps the stream
    has (None: as many as asked for). ``density``: the density to run it at, where the
    stream chooses its own (None: the caller's).
    """

    name: str
    layout: Layout
    shared: Callable[[int, torch.Generator], torch.Tensor]
    description: str
    steps: int | None = None
    noise_ratio: float = 0.0
    density: float | None = None

    def source(
        self, step: int, generator: torch.Generator, noise: torch.Generator | None = None
    ) -> GradientSource:
        """``gradient_for(rank, out)`` of step ``step``: s_t + ρ·rms_layer(s_t)·z, with z
        drawn from ``noise`` (default: ``generator``, after s_t)."""
        shared = self.shared(step, generator)
        return with_noise(
            shared, self.layout, self.noise_ratio, generator if noise is None else noise
        )
