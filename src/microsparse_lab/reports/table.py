"""The results table of a set of runs, as rows of numbers, Markdown and CSV.

Example:
    >>> from microsparse_lab.reports import load_runs, results_table, to_markdown
    >>> runs = load_runs(["runs/compare"])  # doctest: +SKIP
    >>> print(to_markdown(results_table(runs)))  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from typing import Any

from microsparse_lab.reports.runs import Metric, Run, RunError

TARGET_FRACTION = 0.95
"""Default target: 95 % of the dense run's final metric (lower is better: 105 %)."""


@dataclass(frozen=True)
class Target:
    """The metric value a run must reach, and where that value came from."""

    value: float | None
    source: str

    def reached(self, metric: Metric, value: float) -> bool:
        return self.value is not None and metric.better(value, self.value)


@dataclass(frozen=True)
class Table:
    """One row per run; ``columns`` are (key, Markdown header, format) in display order."""

    metric: Metric
    target: Target
    rows: list[dict[str, Any]]
    columns: list[tuple[str, str, str]]


def common_metric(runs: list[Run]) -> Metric:
    """The metric all ``runs`` share; RunError if they record different ones."""
    if not runs:
        raise RunError("no runs to report")
    metrics = {run.metric for run in runs}
    if len(metrics) > 1:
        names = ", ".join(f"{run.label}: {run.metric.name}" for run in runs)
        raise RunError(f"the runs record different metrics ({names}); report them separately")
    return runs[0].metric


def choose_target(
    runs: list[Run], given: float | None = None, fraction: float = TARGET_FRACTION
) -> Target:
    """``given`` if set; else ``fraction`` (95 %) of the dense run's final metric (105 % when
    lower is better); else the same fraction of the best final metric among the runs.

    Example:
        >>> choose_target([], given=0.9)
        Target(value=0.9, source='given (--target)')
    """
    if given is not None:
        return Target(given, "given (--target)")
    metric = common_metric(runs)
    dense = [r.final_metric for r in runs if r.sparsifier == "dense" and r.final_metric is not None]
    finals = [r.final_metric for r in runs if r.final_metric is not None]
    if not finals:
        return Target(None, "none: no run recorded its metric")
    if dense:
        reference, of = dense[0], "the dense run's final"
    else:
        reference = max(finals) if metric.higher_is_better else min(finals)
        of = "the best run's final"
    if metric.higher_is_better:
        return Target(fraction * reference, f"{fraction:.0%} of {of} {metric.name}")
    factor = 2 - fraction
    return Target(factor * reference, f"{factor:.0%} of {of} {metric.name} (lower is better)")


def time_to_target(run: Run, target: Target) -> tuple[int | None, float | None]:
    """(epochs trained, wall seconds) when ``run`` first reached the target, or (None, None)."""
    for epochs, value, seconds in run.metric_points():
        if target.reached(run.metric, value):
            return epochs, seconds
    return None, None


def cost_to_target(run: Run, epochs: int | None) -> tuple[int | None, float | None]:
    """(steps, bytes one worker sent) up to the end of epoch ``epochs`` (None: not reached)."""
    if epochs is None:
        return None, None
    steps = [record for record in run.steps if int(record.get("epoch", 0)) < epochs]
    return len(steps), float(sum(record.get("bytes_sent", 0) for record in steps))


def results_table(
    runs: list[Run], target: float | None = None, fraction: float = TARGET_FRACTION
) -> Table:
    """The comparison of ``runs``: quality, time to target, traffic and time per step.

    Times per step are means over all steps of rank 0's timers; ``other`` is the rest of the
    step (optimizer, loss averaging; under the DDP hook selection and exchange run inside
    backward and are counted as compute).
    """
    metric = common_metric(runs)
    chosen = choose_target(runs, target, fraction)
    rows = [_row(run, metric, chosen) for run in runs]
    name = metric.name
    better = "higher" if metric.higher_is_better else "lower"
    columns = [  # a line per kind: the run, its quality, to the target, selection, traffic, time
        ("run", "run", "s"), ("workers", "n", "d"), ("parameters", "d", "d"),
        ("target_density", "δ", ".3g"), ("steps", "steps", "d"),
        ("final_metric", f"final {name} ({better} is better)", ".4g"),
        ("best_metric", f"best {name}", ".4g"),
        ("epochs_to_target", "epochs to target", "d"), ("seconds_to_target", "s to target", ".1f"),
        ("steps_to_target", "steps to target", "d"),
        ("bytes_to_target", "MB/worker to target", "mb"),
        ("mean_density", "mean density", ".3g"), ("ratio_error", r"mean \|K/k−1\|", ".3f"),
        ("ratio_error_second_half", r"\|K/k−1\|, 2nd half", ".3f"),
        ("build_up", "build-up K/k", ".2f"), ("padding_overhead", "index padding", ".2f"),
        ("bytes_per_step", "KB/worker/step", "kb"), ("traffic_percent", "% of dense", ".2f"),
        ("compute_ms", "compute ms", ".1f"), ("select_ms", "select ms", ".1f"),
        ("exchange_ms", "exchange ms", ".1f"), ("other_ms", "other ms", ".1f"),
        ("step_ms", "step ms", ".1f"), ("wall_seconds", "wall s", ".0f"),
    ]  # fmt: skip
    return Table(metric, chosen, rows, columns)


def to_markdown(table: Table) -> str:
    """Two Markdown tables (quality, then traffic and time) and a line naming the target."""
    keys = [key for key, _, _ in table.columns]
    split = keys.index("mean_density")
    quality = table.columns[:split]
    cost = [table.columns[0], *table.columns[split:]]
    lines = [
        f"Target {table.metric.name}: {_format(table.target.value, '.4g')} "
        f"({table.target.source}).",
        "",
        *_markdown_block(table.rows, quality),
        "",
        *_markdown_block(table.rows, cost),
    ]
    return "\n".join(lines) + "\n"


def to_csv(table: Table) -> str:
    """Every column of every row, raw numbers, plus the metric's name and the target."""
    out = io.StringIO()
    metric_fields = ["metric", "higher_is_better", "final_metric", "best_metric", "target"]
    fields = [key for key, _, _ in table.columns if key not in metric_fields] + metric_fields
    writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in table.rows:
        writer.writerow(
            {
                **{key: "" if value is None else value for key, value in row.items()},
                "metric": table.metric.name,
                "higher_is_better": table.metric.higher_is_better,
                "target": "" if table.target.value is None else table.target.value,
            }
        )
    return out.getvalue()


def _row(run: Run, metric: Metric, target: Target) -> dict[str, Any]:
    values = run.metric_per_epoch()
    best = (max if metric.higher_is_better else min)(values) if values else None
    epochs, seconds = time_to_target(run, target)
    steps_to_target, bytes_to_target = cost_to_target(run, epochs)
    step_ms = 1000 * run.mean("step_seconds")
    compute, select, exchange = (
        1000 * run.mean(f"{part}_seconds") for part in ("compute", "select", "exchange")
    )
    inside = 0.0 if run.config.get("integration") == "ddp" else select + exchange
    sent, dense = run.mean("bytes_sent"), run.mean("dense_bytes")
    return {
        "run": run.label,
        "sparsifier": run.sparsifier,
        "workers": run.world_size,
        "target_density": run.density,
        "steps": len(run.steps),
        "epochs": len(run.epochs),
        "final_metric": run.final_metric,
        "best_metric": best,
        "epochs_to_target": epochs,
        "seconds_to_target": seconds,
        "steps_to_target": steps_to_target,
        "bytes_to_target": bytes_to_target,
        "mean_density": run.mean("density"),
        "ratio_error": run.mean("ratio_error"),
        "ratio_error_second_half": run.mean("ratio_error", first=len(run.steps) // 2),
        "build_up": run.mean("build_up"),
        "padding_overhead": run.mean("padding_overhead"),
        "bytes_per_step": sent,
        "traffic_percent": 100 * sent / dense if dense else math.nan,
        "compute_ms": compute,
        "select_ms": select,
        "exchange_ms": exchange,
        "other_ms": step_ms - compute - inside,
        "step_ms": step_ms,
        "wall_seconds": run.wall_seconds(),
        "parameters": run.parameters,
    }


def _markdown_block(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> list[str]:
    lines = [
        "| " + " | ".join(header for _, header, _ in columns) + " |",
        "|" + "|".join("---" if fmt == "s" else "---:" for _, _, fmt in columns) + "|",
    ]
    for row in rows:
        lines.append(
            "| " + " | ".join(_format(row.get(key), fmt) for key, _, fmt in columns) + " |"
        )
    return lines


def _format(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if fmt == "s":
        return str(value)
    if fmt == "kb":
        return f"{value / 1000:.1f}"
    if fmt == "mb":
        return f"{value / 1e6:.3g}" if value < 1e9 else f"{value / 1e6:,.0f}"
    if fmt == "d":
        return str(int(value))
    return format(value, fmt)
