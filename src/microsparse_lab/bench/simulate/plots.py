"""``simulate.png`` (K/k, padding, bytes, selection vs n) and ``predict.png``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from microsparse_lab.reports.plots import pyplot


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """``simulate.png`` (K/k, padding, bytes, selection vs n) and ``predict.png``."""
    plt = pyplot()
    rows = result["rows"]
    labels = list(dict.fromkeys(r["sparsifier"] for r in rows))
    panels = [
        ("build_up", "build-up K/k", "log"),
        ("padding", "index padding n·m/K − 1", "symlog"),
        ("bytes_per_worker", "bytes sent per worker per step", "log"),
        ("select_ms", "selection ms per worker (median)", "log"),
    ]
    figure, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for axis, (key, title, scale) in zip(axes.flat, panels):
        for label in labels:
            mine = [r for r in rows if r["sparsifier"] == label]
            if scale == "log":  # zeros (nothing sent, nothing selected) have no place there
                mine = [r for r in mine if r[key] and r[key] > 0]
            if key == "padding":  # one worker exchanges no indices
                mine = [r for r in mine if r["world_size"] > 1]
            axis.plot(
                [r["world_size"] for r in mine],
                [r[key] for r in mine],
                marker="o",
                markersize=3,
                label=label,
            )
        _workers_axis(axis, sorted({r["world_size"] for r in rows}))
        if scale == "symlog":
            axis.set_yscale("symlog", linthresh=0.1)
            axis.set_ylim(bottom=0)
        else:
            axis.set_yscale(scale)
        axis.set_title(title, fontsize=9)
        axis.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    figure.suptitle(
        f"{result['numel']:,} parameters, density {result['config']['density']:g}", fontsize=10
    )
    figure.tight_layout()
    paths = [out / "simulate.png"]
    figure.savefig(paths[0], dpi=90)
    plt.close(figure)
    if "prediction" in result:
        prediction = result["prediction"]
        rates = prediction["config"]["rates_gbit"]
        figure, axes = plt.subplots(
            1, len(rates), figsize=(4.2 * len(rates), 3.8), squeeze=False, sharey=True
        )
        for axis, gbit in zip(axes[0], rates):
            mine = [r for r in prediction["rows"] if r["gbit_per_s"] == gbit]
            for label in dict.fromkeys(r["sparsifier"] for r in mine):
                points = [r for r in mine if r["sparsifier"] == label]
                axis.plot([r["world_size"] for r in points], [r["step_ms"] for r in points],
                          marker="o", markersize=3, label=label)  # fmt: skip
            _workers_axis(axis, sorted({r["world_size"] for r in mine}))
            axis.set_yscale("log")
            axis.set_title(f"{gbit:g} Gbit/s", fontsize=9)
            axis.grid(True, alpha=0.3)
        axes[0][0].set_ylabel("predicted step time, ms")
        axes[0][-1].legend(fontsize=7, loc="upper left")
        figure.tight_layout()
        paths.append(out / "predict.png")
        figure.savefig(paths[-1], dpi=90)
        plt.close(figure)
    return paths


def _workers_axis(axis: Any, workers: list[int]) -> None:
    axis.set_xscale("log", base=2)
    axis.set_xticks(workers, [str(n) for n in workers])
    axis.minorticks_off()
    axis.set_xlabel("workers n")
