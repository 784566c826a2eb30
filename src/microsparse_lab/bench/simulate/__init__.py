"""``microsparse simulate``: n virtual workers through every sparsifier's exact selection rule.

Worker r's gradient at step t is a shared component plus its own mini-batch noise:

    g_{r,t} = s_t + ρ · rms_layer(s_t) · z_{r,t},   z ~ N(0, 1) independent per worker and step,

where s_t is the average of the captured ranks' real gradients at step t (``--capture DIR``,
cycled if the run is longer than the capture) or a synthetic Gaussian with per-layer scales,
and rms_layer(s_t) is the root-mean-square of s_t over the parameter holding each entry. ρ is
given (``--noise-ratio``) or estimated from the spread between the captured ranks' gradients
(each captured rank's gradient is one worker's mini-batch gradient). Workers run in one
process (:class:`~microsparse_lab.bench.virtual.VirtualCluster`), each with its own sparsifier
bound with ``bind(layout, r, n)`` and its own residual.

Per (sparsifier, n) it reports, as medians over the measured steps: build-up K/k (and its
mean), the
compression ratio error |K/k − 1|, proposals over K (Σ k_r / K: the overlap of union
selections; for the ``fixed`` exchange, how many proposals its capacity held back), the
padding overhead of the index all-gather (n · m / K − 1, m the indices in each rank's
message: max_r k_r when padded, the capacity when fixed), the imbalance of the ranks' own
picks (n · max_r k_r / Σ_r k_r − 1, before a fixed capacity cuts them), the bytes one worker
sends (the reducer's collectives, priced by ``microsparse.comm``'s ring model) and their
ratio to a dense all-reduce and to the ideal (:func:`ideal_bytes`: K int32 indices and K
float32 values, nothing else), and the selection time per worker (median and slowest).

By default n runs up to 64 (:data:`DEFAULT_WORKERS`): every sparsifier at those n takes a few
minutes on two cores and under 2 GB. n = 256 and 1024 (:data:`EXACT_WORKERS`) are simulated
only when asked for: n × d residuals (0.9 GB at n = 1024 for the MNIST CNN's d) plus each
worker's buffers, about 13 MB per worker where every entry is selected (``hard_threshold`` on
the synthetic gradient). Without them :func:`predict` takes the message shapes of n = 256 and
1024 from the largest simulated n, and says so.

The package, one job a module: :mod:`.config` (what a run is asked for), :mod:`.stream` (the
stream above), :mod:`.runner` (the run, :func:`run`), :mod:`.summary` (one row's medians and
bytes), :mod:`.prediction` (:func:`predict`), :mod:`.testbed` (:func:`validate` against the
test bed), :mod:`.report` (``simulate.md``, :func:`write`) and :mod:`.plots`.

Example:
    >>> result = run(SimulateConfig(workers=(1, 4), numel=20_000, steps=3))  # doctest: +SKIP
"""

from __future__ import annotations

from microsparse_lab.bench.simulate.config import (
    DEFAULT_NOISE_RATIO,
    DEFAULT_WORKERS,
    EXACT_WORKERS,
    SMALLCNN_NUMEL,
    VALUE_BYTES,
    SimulateConfig,
)
from microsparse_lab.bench.simulate.plots import plot
from microsparse_lab.bench.simulate.prediction import (
    PredictConfig,
    beyond_note,
    capacity_at,
    nearest_simulated,
    predict,
    shapes_from,
)
from microsparse_lab.bench.simulate.report import (
    markdown,
    markdown_peer_validation,
    markdown_prediction,
    markdown_validation,
    write,
)
from microsparse_lab.bench.simulate.runner import Plan, run
from microsparse_lab.bench.simulate.stream import estimate_noise_ratio, simulated_stream
from microsparse_lab.bench.simulate.summary import ideal_bytes, shape_of, step_bytes, summarize
from microsparse_lab.bench.simulate.testbed import validate

__all__ = [
    "DEFAULT_NOISE_RATIO",
    "DEFAULT_WORKERS",
    "EXACT_WORKERS",
    "SMALLCNN_NUMEL",
    "VALUE_BYTES",
    "Plan",
    "PredictConfig",
    "SimulateConfig",
    "beyond_note",
    "capacity_at",
    "estimate_noise_ratio",
    "ideal_bytes",
    "markdown",
    "markdown_peer_validation",
    "markdown_prediction",
    "markdown_validation",
    "nearest_simulated",
    "plot",
    "predict",
    "run",
    "shape_of",
    "shapes_from",
    "simulated_stream",
    "step_bytes",
    "summarize",
    "validate",
    "write",
]
