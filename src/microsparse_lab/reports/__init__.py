"""Reports on saved runs: a results table (Markdown, CSV), PNG plots, TensorBoard events.

They read only the files ``microsparse train`` writes, so any run directory can be reported
on later, on any machine.

Example:
    >>> from microsparse_lab.reports import load_runs, write_report
    >>> write_report(load_runs(["runs/compare"]), "runs/compare")  # doctest: +SKIP
    [PosixPath('runs/compare/results.md'), PosixPath('runs/compare/results.csv'), ...]
"""

from __future__ import annotations

from pathlib import Path

from microsparse_lab.reports.plots import PLOTS, write_plots
from microsparse_lab.reports.runs import Metric, Run, RunError, find_runs, load_run, load_runs
from microsparse_lab.reports.table import (
    TARGET_FRACTION,
    Table,
    Target,
    choose_target,
    results_table,
    to_csv,
    to_markdown,
)
from microsparse_lab.reports.tensorboard import tensorboard_available, write_tensorboard


def write_report(
    runs: list[Run],
    out: str | Path,
    target: float | None = None,
    plots: bool = True,
    fraction: float = TARGET_FRACTION,
) -> list[Path]:
    """Write ``results.md``, ``results.csv`` and (unless ``plots=False``) the PNGs into ``out``;
    without ``target`` it is ``fraction`` of the dense run's final metric."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = results_table(runs, target, fraction)
    markdown, csv = out / "results.md", out / "results.csv"
    markdown.write_text(to_markdown(table), encoding="utf-8")
    csv.write_text(to_csv(table), encoding="utf-8")
    written = [markdown, csv]
    if plots:
        written += write_plots(runs, out, table.target)
    return written


__all__ = [
    "PLOTS",
    "Metric",
    "Run",
    "RunError",
    "Table",
    "Target",
    "choose_target",
    "find_runs",
    "load_run",
    "load_runs",
    "results_table",
    "tensorboard_available",
    "to_csv",
    "to_markdown",
    "write_plots",
    "write_report",
    "write_tensorboard",
]
