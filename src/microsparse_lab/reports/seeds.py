"""Studies over seeds: every variant's runs, one per seed, and their gap to a reference.

A study directory holds one subdirectory per variant (a sparsifier with its options), and in
each one run directory per seed (``STUDY/VARIANT/seed-S``, as ``microsparse train --out``
wrote it). The table compares each variant with the reference variant (``dense``) seed by
seed: in points for a metric where higher is better (accuracy), in per cent of the
reference's value where lower is better (perplexity), and in nats for a loss (a gap of g
nats in cross-entropy is a factor e^g in perplexity). The metric is the task's unless
``load_study`` is given another recorded per epoch, such as ``train_loss``.

Example:
    >>> from microsparse_lab.reports.seeds import load_study, gap_table
    >>> print(gap_table(load_study("runs/quality/mnist"), at=(5, 10), window=(16, 20)))
    ... # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from statistics import fmean

from microsparse_lab.reports.plots import DPI, SIZE, pyplot
from microsparse_lab.reports.runs import (
    EPOCHS_FILE,
    KNOWN_METRICS,
    Metric,
    Run,
    RunError,
    find_runs,
    load_run,
)


@dataclass(frozen=True)
class Variant:
    """One variant of a study: its runs, one per seed, in seed order."""

    name: str
    runs: list[Run]

    @property
    def metric(self) -> Metric:
        return self.runs[0].metric

    @property
    def seeds(self) -> list[int]:
        return [int(run.config.get("seed", index)) for index, run in enumerate(self.runs)]

    @cached_property
    def curves(self) -> list[list[float]]:
        """Each seed's metric after every epoch (read once from the runs' records)."""
        return [run.metric_per_epoch() for run in self.runs]

    def at(self, epoch: int) -> list[float] | None:
        """Each seed's metric after ``epoch`` epochs (1-based), None if a run lacks it."""
        if any(len(curve) < epoch for curve in self.curves):
            return None
        return [curve[epoch - 1] for curve in self.curves]

    def window(self, first: int, last: int) -> list[float] | None:
        """Each seed's mean metric over epochs ``first``..``last``, None if a run lacks one."""
        values = [self.at(epoch) for epoch in range(first, last + 1)]
        if any(v is None for v in values):
            return None
        return [fmean(per_epoch[i] for per_epoch in values) for i in range(len(self.runs))]

    def mean_density(self) -> float:
        """K/d over every step of every seed's run, a warm-up included."""
        return fmean(run.mean("selected") / run.parameters for run in self.runs)

    def mean_bytes(self) -> float:
        """Bytes one rank sent per step, over every step of every seed's run: with 16-bit
        values an entry costs fewer bytes, so equal density is not equal traffic."""
        return fmean(run.mean("bytes_sent") for run in self.runs)

    def bytes_at(self, epoch: int) -> float:
        """Bytes one rank had sent after ``epoch`` epochs, the mean over seeds (NaN if a run
        lacks the epoch)."""
        return fmean(run.bytes_after_epochs().get(epoch, math.nan) for run in self.runs)

    @property
    def target_density(self) -> float:
        """δ, the density the variant's runs aimed at after any warm-up."""
        return self.runs[0].density


def load_study(root: str | Path, metric: str | None = None) -> list[Variant]:
    """Every variant directory under ``root`` that holds finished runs (sorted by name, with
    ``dense`` first), compared by ``metric`` (a name of ``KNOWN_METRICS`` recorded in every
    run's ``epochs.jsonl``; default: each run's task metric)."""
    if metric is not None and metric not in KNOWN_METRICS:
        raise RunError(f"metric must be one of {', '.join(KNOWN_METRICS)}; got {metric!r}")
    root = Path(root)
    if not root.is_dir():
        raise RunError(f"{root} is not a directory")
    variants = []
    for directory in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            paths = find_runs([directory])
        except RunError:
            continue
        runs = [load_run(path) for path in paths]
        runs = [run for run in runs if run.summary is not None]
        if metric is not None:
            runs = [_compared_by(run, metric) for run in runs]
        if runs:
            runs.sort(key=lambda run: int(run.config.get("seed", 0)))
            variants.append(Variant(directory.name, runs))
    if not variants:
        raise RunError(f"{root} holds no VARIANT/RUN directories with finished runs")
    variants.sort(key=lambda v: (v.name != "dense", v.name))
    return variants


def _compared_by(run: Run, name: str) -> Run:
    if not any(name in record for record in run.epochs):
        raise RunError(f"{run.path / EPOCHS_FILE} records no {name!r}")
    return replace(run, metric=Metric(name, KNOWN_METRICS[name]))


def _is_loss(metric: Metric) -> bool:
    return metric.name.endswith("_loss")


def gaps(variant: Variant, reference: Variant, values: str, *args: int) -> list[float] | None:
    """Per-seed gap of ``variant`` to ``reference`` (paired by seed) for ``values`` ("at" or
    "window"): points (× 100) where higher is better, nats for a loss, else per cent of the
    reference."""
    mine = getattr(variant, values)(*args)
    theirs = {seed: v for seed, v in zip(reference.seeds, getattr(reference, values)(*args) or [])}
    if mine is None or any(seed not in theirs for seed in variant.seeds):
        return None
    pairs = [(m, theirs[seed]) for m, seed in zip(mine, variant.seeds)]
    if variant.metric.higher_is_better:
        return [100 * (m - r) for m, r in pairs]
    if _is_loss(variant.metric):
        return [m - r for m, r in pairs]
    return [100 * (m / r - 1) for m, r in pairs]


def gap_table(
    variants: list[Variant],
    at: tuple[int, ...] = (5, 10),
    window: tuple[int, int] | None = None,
    reference: str = "dense",
) -> str:
    """A Markdown table: each variant's mean density over the run (warm-up included) and bytes
    sent per step, and its mean metric and mean gap (range over seeds) at each epoch of ``at``
    and over the epochs of ``window``."""
    base = next((v for v in variants if v.name == reference), None)
    if base is None:
        raise RunError(f"the study has no {reference!r} variant to compare with")
    unit = "pt" if base.metric.higher_is_better else "nat" if _is_loss(base.metric) else "%"
    digits = 3 if unit == "nat" else 1
    columns = [f"epoch {epoch}" for epoch in at]
    if window is not None:
        columns.append(f"mean of epochs {window[0]}–{window[1]}")
    header = ["variant", "seeds", "mean density K/d", "bytes/step"] + columns
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    queries = [("at", (epoch,)) for epoch in at]
    if window is not None:
        queries.append(("window", window))
    for variant in variants:
        cells = [variant.name, ",".join(map(str, variant.seeds)),
                 "1" if variant is base else f"{variant.mean_density():.3g}",
                 f"{variant.mean_bytes():,.0f}"]  # fmt: skip
        for values, args in queries:
            own = getattr(variant, values)(*args)
            if own is None:
                cells.append("n/a")
                continue
            text = f"{fmean(own):.4g}"
            if variant is not base:
                gap = gaps(variant, base, values, *args)
                if gap is not None:
                    text += (f" ({fmean(gap):+.{digits}f} {unit}; "
                             f"{min(gap):+.{digits}f}…{max(gap):+.{digits}f})")  # fmt: skip
            cells.append(text)
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


OVERSPENT = 1.1
"""Variants whose mean density exceeds this many times the study's smallest target density
are drawn dashed."""


def plot_study(variants: list[Variant], out: str | Path, title: str = "") -> Path:
    """Metric against epochs and against the bytes a rank had sent (log scale): the mean over
    seeds, and a band from the lowest to the highest."""
    plt = pyplot()
    sparse = [v.target_density for v in variants if v.runs[0].sparsifier != "dense"]
    budget = OVERSPENT * min(sparse, default=1.0)
    figure, (by_epoch, by_bytes) = plt.subplots(
        1, 2, figsize=(SIZE[0] * 2.2, SIZE[1] * 1.25), sharey=True
    )
    for variant in variants:
        epochs = min(len(curve) for curve in variant.curves)
        if epochs == 0:
            continue
        xs = list(range(1, epochs + 1))
        per_epoch = [variant.at(epoch) or [math.nan] for epoch in xs]
        means = [fmean(v) for v in per_epoch]
        band = [min(v) for v in per_epoch], [max(v) for v in per_epoch]
        dense = variant.runs[0].sparsifier == "dense"
        spent = variant.mean_density()
        label = variant.name if dense else f"{variant.name} ({spent:.2g})"
        style = "--" if not dense and spent > budget else "-"  # beyond the budget
        (line,) = by_epoch.plot(xs, means, style, label=label)
        by_epoch.fill_between(xs, *band, color=line.get_color(), alpha=0.15, linewidth=0)
        sent = [variant.bytes_at(epoch) / 1e6 for epoch in xs]
        by_bytes.plot(sent, means, style, marker=".", color=line.get_color())
        by_bytes.fill_between(sent, *band, color=line.get_color(), alpha=0.15, linewidth=0)
    by_epoch.set_xlabel("epoch")
    by_epoch.xaxis.get_major_locator().set_params(integer=True)
    by_epoch.set_ylabel(variants[0].metric.name.replace("_", " "))
    by_bytes.set_xlabel("MB one rank sent (log scale)")
    by_bytes.set_xscale("log")
    if not variants[0].metric.higher_is_better and not _is_loss(variants[0].metric):
        by_epoch.set_yscale("log")  # perplexity: ratios matter; a loss is already a logarithm
    figure.suptitle(title or f"mean of {len(variants[0].runs)} seeds (band: lowest to "
                    f"highest); in brackets: mean density; dashed: over {budget:.2g}")  # fmt: skip
    for axes in (by_epoch, by_bytes):
        axes.grid(alpha=0.3)
    by_epoch.legend(fontsize="small")
    figure.tight_layout()
    path = Path(out)
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path
