"""Convert saved runs into TensorBoard event files (needs the optional ``tensorboard`` package).

Each run becomes one subdirectory of the log directory, so TensorBoard overlays the runs:
per-step scalars under ``step/`` (loss, density, K/k, threshold, bytes, timers) and the
per-epoch metric under ``epoch/``.

Example:
    >>> from microsparse_lab.reports import load_runs, write_tensorboard
    >>> write_tensorboard(load_runs(["runs/compare"]), "runs/tb")  # doctest: +SKIP
    $ tensorboard --logdir runs/tb
"""

from __future__ import annotations

import math
from pathlib import Path

from microsparse_lab.reports.runs import Run

STEP_SCALARS = (
    "loss",
    "density",
    "target_density",
    "build_up",
    "ratio_error",
    "threshold",
    "bytes_sent",
    "compute_seconds",
    "select_seconds",
    "exchange_seconds",
    "step_seconds",
)

MISSING = (
    "TensorBoard output needs the tensorboard package, which is not installed: "
    "pip install tensorboard"
)


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True


def write_tensorboard(runs: list[Run], logdir: str | Path) -> list[Path]:
    """Write each run's scalars into ``logdir/<run label>``; returns those directories.

    Raises ModuleNotFoundError with an install hint when tensorboard is missing.
    """
    if not tensorboard_available():
        raise ModuleNotFoundError(MISSING)
    from torch.utils.tensorboard import SummaryWriter

    written = []
    for run in runs:
        directory = Path(logdir, run.label.replace("/", "_"))
        with SummaryWriter(log_dir=str(directory)) as writer:
            for record in run.steps:
                for key in STEP_SCALARS:
                    value = record.get(key)
                    if isinstance(value, (int, float)) and math.isfinite(value):
                        writer.add_scalar(f"step/{key}", value, record["step"])
            for epochs, value, seconds in run.metric_points():
                writer.add_scalar(f"epoch/{run.metric.name}", value, epochs)
                writer.add_scalar(f"epoch/{run.metric.name}_vs_seconds", value, round(seconds))
        written.append(directory)
    return written
