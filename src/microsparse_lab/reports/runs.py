"""Load a run directory written by ``microsparse train`` into a typed :class:`Run`.

A run directory holds ``metrics.jsonl`` (one record per step), ``epochs.jsonl`` (one record
per epoch, with the task's quality metric) and, once the run finished, ``summary.json``. The
metric is not assumed to be accuracy: its name and direction come from the run's files (see
:func:`find_metric`), so perplexity (lower is better) and HR@10 work like accuracy does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from statistics import fmean
from typing import Any

METRICS_FILE = "metrics.jsonl"
EPOCHS_FILE = "epochs.jsonl"
SUMMARY_FILE = "summary.json"

KNOWN_METRICS: dict[str, bool] = {
    "test_accuracy": True,
    "valid_accuracy": True,
    "accuracy": True,
    "valid_perplexity": False,
    "test_perplexity": False,
    "perplexity": False,
    "hr@10": True,
    "ndcg@10": True,
    "test_loss": False,
    "valid_loss": False,
    "train_loss": False,
}
"""Metric names in order of preference, each with "higher is better"."""

_NOT_METRICS = {"epoch", "steps", "step", "seconds", "train_loss", "lr", "value"}


class RunError(ValueError):
    """A run directory is missing, empty or unreadable; the message names the file."""


@dataclass(frozen=True)
class Metric:
    """The quality metric of a task: its name (the key in ``epochs.jsonl`` and
    ``summary.json``) and its direction."""

    name: str
    higher_is_better: bool

    def better(self, a: float, b: float) -> bool:
        """Whether ``a`` is at least as good as ``b``."""
        return a >= b if self.higher_is_better else a <= b


@dataclass(frozen=True)
class Run:
    """One training run as its files describe it.

    Example:
        >>> run = load_run("runs/compare/micro")  # doctest: +SKIP
        >>> run.label, run.metric.name, run.final_metric  # doctest: +SKIP
        ('micro', 'test_accuracy', 0.947)
    """

    path: Path
    steps: list[dict[str, Any]]
    epochs: list[dict[str, Any]]
    summary: dict[str, Any] | None  # None: the run did not finish
    metric: Metric
    label: str = field(default="")

    @property
    def config(self) -> dict[str, Any]:
        return (self.summary or {}).get("config", {})

    @property
    def sparsifier(self) -> str:
        """The sparsifier, or the DDP hook of a peer run (``--ddp-hook powersgd``)."""
        hook = self.config.get("ddp_hook", "microsparse")
        if hook != "microsparse":
            return str(hook)
        return str(self.config.get("sparsifier") or self.path.name)

    @property
    def task(self) -> str:
        return str((self.summary or {}).get("task") or self.config.get("task") or "mnist")

    @property
    def model(self) -> str | None:
        return (self.summary or {}).get("model") or self.config.get("model")

    @property
    def world_size(self) -> int:
        return int(self.config.get("world_size") or self.steps[-1].get("world_size", 1))

    @property
    def density(self) -> float:
        """The target density of the last step (k / d)."""
        return float(self.steps[-1].get("target_density", math.nan))

    @property
    def parameters(self) -> int:
        return int(self.steps[-1].get("numel", 0))

    def metric_per_epoch(self) -> list[float]:
        """The metric after each epoch that recorded it (None and NaN dropped)."""
        return [value for _, value, _ in self.metric_points()]

    def metric_points(self) -> list[tuple[int, float, float]]:
        """(epochs trained, metric, wall seconds since the start) after each epoch."""
        points = []
        for record, seconds in zip(self.epochs, self.epoch_end_seconds()):
            value = record.get(self.metric.name)
            if isinstance(value, (int, float)) and math.isfinite(value):
                points.append((int(record.get("epoch", len(points))) + 1, float(value), seconds))
        return points

    def epoch_end_seconds(self) -> list[float]:
        """Wall seconds from the start of training to the end of each epoch (with evaluation).

        Uses the epochs' own ``seconds`` when they have them, else the steps' ``step_seconds``
        up to each epoch's last step.
        """
        if self.epochs and all(isinstance(e.get("seconds"), (int, float)) for e in self.epochs):
            return list(accumulate(float(e["seconds"]) for e in self.epochs))
        elapsed = list(accumulate(float(s.get("step_seconds", 0.0)) for s in self.steps))
        ends = []
        for record in self.epochs:
            last = int(record.get("steps", len(self.steps))) - 1
            ends.append(elapsed[min(max(last, 0), len(elapsed) - 1)])
        return ends

    def bytes_after_epochs(self) -> dict[int, float]:
        """Bytes this rank had sent (``bytes_sent``, summed over steps) by the end of each
        epoch, by epochs trained."""
        sent = list(accumulate(float(s.get("bytes_sent", 0.0)) for s in self.steps))
        ends = {}
        for index, record in enumerate(self.epochs):
            last = int(record.get("steps", len(self.steps))) - 1
            if sent:
                ends[int(record.get("epoch", index)) + 1] = sent[min(max(last, 0), len(sent) - 1)]
        return ends

    @property
    def final_metric(self) -> float | None:
        values = self.metric_per_epoch()
        return values[-1] if values else None

    def mean(self, key: str, first: int = 0) -> float:
        """Mean of a per-step field over steps ``first`` onwards (NaN if no step has it)."""
        values = [
            float(s[key])
            for s in self.steps[first:]
            if isinstance(s.get(key), (int, float)) and math.isfinite(s[key])
        ]
        return fmean(values) if values else math.nan

    def wall_seconds(self) -> float:
        if self.summary and "seconds" in self.summary:
            return float(self.summary["seconds"].get("wall", math.nan))
        ends = self.epoch_end_seconds()
        return ends[-1] if ends else math.fsum(s.get("step_seconds", 0.0) for s in self.steps)


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Read one run directory; raise :class:`RunError` naming what is missing or broken."""
    path = Path(path)
    if not path.is_dir():
        raise RunError(f"{path} is not a directory")
    steps = _read_jsonl(path / METRICS_FILE)
    if not steps:
        raise RunError(f"{path / METRICS_FILE} has no step records")
    epochs = _read_jsonl(path / EPOCHS_FILE) if (path / EPOCHS_FILE).exists() else []
    summary = None
    if (path / SUMMARY_FILE).exists():
        try:
            summary = json.loads((path / SUMMARY_FILE).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise RunError(f"{path / SUMMARY_FILE} is not readable JSON: {error}") from None
    metric = find_metric(summary or {}, epochs)
    run = Run(path, steps, epochs, summary, metric)
    return Run(path, steps, epochs, summary, metric, label=label or run.sparsifier)


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Run directories among ``paths``: each path itself if it holds ``metrics.jsonl``, else
    its immediate subdirectories that do (so a ``microsparse compare`` output works too).

    Example:
        >>> find_runs(["runs/compare"])  # doctest: +SKIP
        [PosixPath('runs/compare/dense'), PosixPath('runs/compare/micro')]
    """
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise RunError(f"{path} is not a directory")
        if (path / METRICS_FILE).exists():
            found.append(path)
            continue
        children = sorted(p.parent for p in path.glob(f"*/{METRICS_FILE}"))
        if not children:
            raise RunError(f"{path} has no {METRICS_FILE}, nor any subdirectory with one")
        found.extend(_in_compare_order(path, children))
    return found


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Load every run under ``paths`` (see :func:`find_runs`), labelled by sparsifier, or by
    directory name when two runs share a sparsifier."""
    runs = [load_run(path) for path in find_runs(paths)]
    names = [run.sparsifier for run in runs]
    if len(set(names)) < len(names):
        runs = [load_run(run.path, label=_unique_name(run.path, runs)) for run in runs]
    return runs


def find_metric(summary: dict[str, Any], epochs: list[dict[str, Any]]) -> Metric:
    """The task's metric: as ``summary.json`` names it, else the first known metric name
    that ``epochs.jsonl`` records, else its first other numeric field.

    The summary may name it as ``"metric": "valid_perplexity"``, as
    ``"metric": {"name": ..., "higher_is_better": ...}`` or as ``"metric_name"``; the
    direction comes from ``higher_is_better`` when given, else from the name.

    Example:
        >>> find_metric({}, [{"epoch": 0, "valid_perplexity": 180.0}])
        Metric(name='valid_perplexity', higher_is_better=False)
        >>> find_metric({"metric": {"name": "hr@10", "higher_is_better": True}}, [])
        Metric(name='hr@10', higher_is_better=True)
    """
    declared = summary.get("metric")
    name, higher = None, summary.get("higher_is_better", summary.get("metric_higher_is_better"))
    if isinstance(declared, dict):
        name = declared.get("name")
        higher = declared.get("higher_is_better", higher)
    elif isinstance(declared, str):
        name = declared
    name = name or summary.get("metric_name")
    if not name:  # an unfinished run: epochs.jsonl may name its headline metric
        name = next((e["metric"] for e in epochs if isinstance(e.get("metric"), str)), None)
    if not name:
        recorded = [key for record in epochs for key in record]
        name = next((known for known in KNOWN_METRICS if known in recorded), None)
        if name is None:
            numeric = [
                key
                for record in epochs
                for key, value in record.items()
                if isinstance(value, (int, float)) and key not in _NOT_METRICS
            ]
            name = numeric[0] if numeric else "test_accuracy"
    if not isinstance(higher, bool):
        higher = KNOWN_METRICS.get(name, _higher_is_better_by_name(name))
    return Metric(str(name), higher)


def _higher_is_better_by_name(name: str) -> bool:
    lowered = name.lower()
    return not any(word in lowered for word in ("perplexity", "loss", "error", "rmse", "mae"))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunError(f"{path} is missing") from None
    except OSError as error:
        raise RunError(f"{path} cannot be read: {error.strerror}") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(text.splitlines()):  # a run killed mid-write: drop its last line
                break
            raise RunError(f"{path}:{number} is not valid JSON") from None
    return records


def _in_compare_order(parent: Path, children: list[Path]) -> list[Path]:
    # microsparse compare records the order the user asked for; keep it in tables and legends.
    try:
        order = json.loads((parent / "compare.json").read_text(encoding="utf-8"))["runs"]
    except (OSError, ValueError, KeyError, TypeError):
        return children
    rank = {name: index for index, name in enumerate(order)}
    return sorted(children, key=lambda child: (rank.get(child.name, len(rank)), child.name))


def _unique_name(path: Path, runs: list[Run]) -> str:
    names = [run.path.name for run in runs]
    if names.count(path.name) == 1:
        return path.name
    return f"{path.parent.name}/{path.name}"
