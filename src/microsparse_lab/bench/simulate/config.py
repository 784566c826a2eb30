"""What one ``microsparse simulate`` run is asked for: its n, density, steps, stream and
value width, and the defaults that keep it small."""

from __future__ import annotations

from dataclasses import dataclass

SMALLCNN_NUMEL = 215_370
"""Parameters of ``microsparse train``'s MNIST CNN: the default synthetic d."""
DEFAULT_WORKERS = (1, 4, 16, 64)
"""The n simulated unless told: every sparsifier in a few minutes on two cores, < 2 GB."""
EXACT_WORKERS = (1, 4, 16, 64, 256, 1024)
"""Every n that ``--predict`` predicts, simulated: tens of minutes and up to ~14 GB."""
DEFAULT_NOISE_RATIO = 1.0
VALUE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class SimulateConfig:
    workers: tuple[int, ...] = DEFAULT_WORKERS
    density: float = 0.05  # with d = 215,370: k = 10,768, the paper's k (ResNet-18 at 0.001)
    steps: int = 10
    warmup: int = 2  # first steps left out of the medians
    capture: str | None = None  # directory of captured gradients; None: synthetic
    numel: int = SMALLCNN_NUMEL  # synthetic d (a capture brings its own)
    noise_ratio: float | None = None  # ρ; None: estimated from the capture, else 1.0
    threshold_start: str = "settled"  # or "cold": adaptive thresholds from 1/(2·sqrt(k))
    value_dtype: str = "float32"  # the reducer's value_dtype: "bfloat16", "float16" halve values
    only: tuple[str, ...] | None = None  # variant labels; None: every one
    seed: int = 0
