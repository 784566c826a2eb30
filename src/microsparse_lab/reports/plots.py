"""PNG plots of a set of runs (matplotlib, Agg backend: no display needed).

Example:
    >>> from microsparse_lab.reports import load_runs, write_plots
    >>> write_plots(load_runs(["runs/compare"]), "runs/compare")  # doctest: +SKIP
    [PosixPath('runs/compare/metric_vs_epoch.png'), ...]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from microsparse_lab.reports.runs import Run
from microsparse_lab.reports.table import Target, choose_target, common_metric

PLOTS = ("metric_vs_epoch", "metric_vs_time", "density_vs_step", "time_breakdown")
"""File names (without ``.png``) that :func:`write_plots` writes."""

SIZE = (6.4, 4.0)
DPI = 80  # small files: these go into the repository's docs


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display), or a message naming the extra."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "plots need matplotlib, which is not installed: pip install 'microsparse[plots]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(runs: list[Run], out: str | Path, target: Target | None = None) -> list[Path]:
    """Write the four plots of :data:`PLOTS` into ``out``; returns their paths."""
    plt = pyplot()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target = target or choose_target(runs)
    written = []
    for name, draw in (
        ("metric_vs_epoch", lambda ax: _metric(ax, runs, target, by_time=False)),
        ("metric_vs_time", lambda ax: _metric(ax, runs, target, by_time=True)),
        ("density_vs_step", lambda ax: _density(ax, runs)),
        ("time_breakdown", lambda ax: _time_breakdown(ax, runs)),
    ):
        figure, ax = plt.subplots(figsize=SIZE, dpi=DPI)
        draw(ax)
        figure.tight_layout()
        path = out / f"{name}.png"
        figure.savefig(path)
        plt.close(figure)
        _shrink(path)
        written.append(path)
    return written


def _shrink(path: Path) -> None:
    # A 128-colour palette keeps line plots sharp at a third of the size (Pillow comes with
    # matplotlib).
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=128)
    small.save(path, optimize=True)


def _color(index: int) -> str:
    # The same run has the same colour in every plot, whichever runs a plot leaves out.
    return f"C{index % 10}"


def _title(runs: list[Run]) -> str:
    tasks = sorted({run.task + (f" / {run.model}" if run.model else "") for run in runs})
    workers = sorted({run.world_size for run in runs})
    return f"{', '.join(tasks)}, {', '.join(map(str, workers))} workers"


def _metric(ax: Any, runs: list[Run], target: Target, by_time: bool) -> None:
    metric = common_metric(runs)
    for index, run in enumerate(runs):
        points = run.metric_points()
        if points:
            xs = [seconds if by_time else epochs for epochs, _, seconds in points]
            ax.plot(
                xs,
                [value for _, value, _ in points],
                marker="o",
                markersize=3,
                label=run.label,
                color=_color(index),
            )
    if target.value is not None:
        ax.axhline(target.value, color="grey", linestyle="--", linewidth=1, label="target")
    ax.set_xlabel("wall time (s)" if by_time else "epoch")
    direction = "higher" if metric.higher_is_better else "lower"
    ax.set_ylabel(f"{metric.name} ({direction} is better)")
    ax.set_title(_title(runs))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _density(ax: Any, runs: list[Run]) -> None:
    # Dense sits at 1.0 and would squash the sparse runs' range: it is left out.
    sparse = [(index, run) for index, run in enumerate(runs) if run.sparsifier != "dense"]
    for index, run in sparse:
        steps = [s["step"] for s in run.steps]
        densities = [s["density"] for s in run.steps]
        ax.plot(steps, densities, linewidth=0.8, label=run.label, color=_color(index))
    for density in sorted({run.density for _, run in sparse}):
        ax.axhline(
            density, color="black", linestyle="--", linewidth=1, label=f"target {density:.3g}"
        )
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("actual density K/d")
    ax.set_title(f"actual density per step ({_title(runs)})")
    ax.grid(alpha=0.3, which="both")
    if sparse:
        ax.legend(fontsize="small", ncol=2)


def _time_breakdown(ax: Any, runs: list[Run]) -> None:
    # Under the DDP hook selection and exchange overlap backward, inside "compute": the bars
    # then overlap too, and "other" is what is left of the step.
    labels = [run.label for run in runs]
    parts = {
        part: [1000 * run.mean(f"{part}_seconds") for run in runs]
        for part in ("compute", "select", "exchange")
    }
    steps = [1000 * run.mean("step_seconds") for run in runs]
    parts["other"] = [
        max(0.0, total - sum(values[i] for values in parts.values()))
        for i, total in enumerate(steps)
    ]
    left = [0.0] * len(runs)
    for part, values in parts.items():
        ax.barh(labels, values, left=left, label=part)
        left = [a + b for a, b in zip(left, values)]
    ax.invert_yaxis()
    ax.set_xlabel("mean ms per step (rank 0)")
    ax.set_title(f"time per step ({_title(runs)})")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize="small")
