"""Rank 0's output: progress bar, ``metrics.jsonl``, ``epochs.jsonl`` and ``summary.json``."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from statistics import fmean
from typing import Any

from tqdm import tqdm

from microsparse.stats import StepStats
from microsparse_lab.training.checkpoint import Position, remove_checkpoints
from microsparse_lab.training.config import TrainConfig
from microsparse_lab.training.rundir import claim
from microsparse_lab.training.tasks import Metric


class RunLog:
    """One JSON line per step and per epoch, flushed as they come, and the summary at the end.

    When resuming from ``position``, the files keep the records before it (steps before
    ``position.step``, epochs before ``position.epoch``) and continue from there; otherwise an
    earlier run's files in ``config.out`` are replaced, its checkpoints deleted. Raises
    :class:`~microsparse_lab.training.rundir.ForeignFileError` before writing anything if a file
    it would replace is not microsparse's.
    """

    def __init__(
        self,
        config: TrainConfig,
        metrics: tuple[Metric, ...],
        total_steps: int,
        position: Position | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.out = Path(config.out)
        self.records: list[dict[str, Any]] = []
        self.epochs: list[dict[str, Any]] = []
        claim(self.out)  # from here on, every run file in it is microsparse's
        if position is None:  # a later --resume would take an earlier run's checkpoint
            remove_checkpoints(self.out)
        for stale in ("summary.json", "error.log"):  # left by an earlier run into this directory
            (self.out / stale).unlink(missing_ok=True)
        if position is not None:
            self.records = _read_records(self.out / "metrics.jsonl", "step", position.step)
            self.epochs = _read_records(self.out / "epochs.jsonl", "epoch", position.epoch)
        # Line-buffered, so that an interrupted run still leaves every finished step on disk.
        self._metrics = open(self.out / "metrics.jsonl", "w", buffering=1, encoding="utf-8")
        self._epoch_file = open(self.out / "epochs.jsonl", "w", buffering=1, encoding="utf-8")
        for record in self.records:
            self._metrics.write(json.dumps(json_safe(record)) + "\n")
        for record in self.epochs:
            self._epoch_file.write(json.dumps(json_safe(record)) + "\n")
        self._epoch_started = time.perf_counter()
        self._bar = tqdm(
            total=total_steps,
            initial=len(self.records),
            unit="step",
            dynamic_ncols=True,
            disable=not config.progress,
        )

    def step(
        self,
        step: int,
        epoch: int,
        loss: float,
        lr: float,
        compute_seconds: float,
        step_seconds: float,
        stats: StepStats,
    ) -> None:
        record = {
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "lr": lr,
            "compute_seconds": compute_seconds,
            "step_seconds": step_seconds,
            **stats.as_record(),
        }
        self.records.append(record)
        self._metrics.write(json.dumps(json_safe(record)) + "\n")
        self._bar.set_postfix(
            {
                "loss": f"{loss:.3f}",
                "density": f"{stats.density:.2e}",
                "K/k": f"{stats.selected / stats.target:.2f}",
            },
            refresh=False,
        )
        self._bar.update()

    def epoch(self, epoch: int, steps: int, values: dict[str, float]) -> None:
        """Record an epoch's metrics: ``metric`` and ``value`` (the headline), each by name."""
        losses = [r["loss"] for r in self.records if r["epoch"] == epoch]
        now = time.perf_counter()
        headline = self.metrics[0].name
        record = {
            "epoch": epoch,
            "steps": steps,
            "train_loss": fmean(losses) if losses else None,
            "metric": headline,
            "value": values[headline],
            **values,
            "seconds": now - self._epoch_started,
        }
        self._epoch_started = now
        self.epochs.append(record)
        self._epoch_file.write(json.dumps(json_safe(record)) + "\n")
        shown = ", ".join(f"{_label(name)} {values[name]:.4f}" for name in _names(self.metrics))
        train_loss = "n/a" if record["train_loss"] is None else f"{record['train_loss']:.4f}"
        say(f"epoch {epoch}: train loss {train_loss}, {shown}, {record['seconds']:.1f} s")

    def finish(
        self,
        options: dict[str, Any],
        world_size: int,
        wall_seconds: float,
        parameters: int,
        speed_choice: dict[str, Any] | None = None,
    ) -> None:
        """Close the files, write ``summary.json`` and print the summary; ``speed_choice``:
        the DDP hook's ``min_speedup`` choice and every rank's median step seconds."""
        self._bar.close()
        self._metrics.close()
        self._epoch_file.close()
        summary = summarize(self.config, self.metrics, self.records, self.epochs, wall_seconds)
        summary["config"].update(world_size=world_size, sparsifier_options=options)
        summary.update(parameters=parameters, target=self.records[-1]["target"])
        if speed_choice is not None:
            summary["min_speedup"] = speed_choice
        (self.out / "summary.json").write_text(json.dumps(json_safe(summary), indent=2) + "\n")
        say(format_summary(summary, self.out))


def summarize(
    config: TrainConfig,
    metrics: tuple[Metric, ...],
    records: list[dict[str, Any]],
    epochs: list[dict[str, Any]],
    wall_seconds: float,
) -> dict[str, Any]:
    """The run's headline numbers from its step and epoch records (see ``summary.json``).

    Timings are rank 0's. The compression ratio error (``ratio_error_mean*``, |K/k - 1|) and
    ``selected_over_target_mean`` count only the sparse steps (``sparse_steps`` of them): a step
    the DDP hook averaged densely (``dense_steps``, ``min_speedup``'s) sends every entry on
    purpose, which is no error of the selection; they are None when no step was sparse. The
    first half of the steps counts as warm-up for the ratio error, because the threshold
    controller moves by at most 0.5 % per step.

    Example:
        >>> summary = summarize(config, metrics, records, epochs, 60.0)  # doctest: +SKIP
        >>> summary["metric"], summary["metrics"], summary["traffic_ratio"]  # doctest: +SKIP
    """
    steps = len(records)  # at least 1: train() runs at least one step
    warmup = steps // 2
    sparse = [r for r in records if r.get("averaging") != "dense"]
    errors = [r["ratio_error"] for r in sparse]
    errors_after_warmup = [r["ratio_error"] for r in sparse if r["step"] >= records[warmup]["step"]]
    step_total = math.fsum(r["step_seconds"] for r in records)
    totals = {
        part: math.fsum(r[f"{part}_seconds"] for r in records)
        for part in ("compute", "select", "exchange")
    }
    # Under DDP the hook's selection and exchange run inside backward (timed as compute).
    inside = 0.0 if config.integration != "loop" else totals["select"] + totals["exchange"]
    totals["other"] = step_total - totals["compute"] - inside
    sent, dense = (sum(r[key] for r in records) for key in ("bytes_sent", "dense_bytes"))
    names = _names(metrics)
    final = {name: epochs[-1][name] for name in names}
    best = {
        metric.name: (max if metric.higher_is_better else min)(e[metric.name] for e in epochs)
        for metric in metrics
    }
    return {
        "config": asdict(config),
        "task": config.task,
        "model": config.model,
        "metric": metrics[0].name,
        "higher_is_better": metrics[0].higher_is_better,
        "metric_names": names,
        "metrics": final,
        "best_metrics": best,
        **final,
        **{f"{name}_per_epoch": [e[name] for e in epochs] for name in names},
        "steps": steps,
        "epochs": len(epochs),
        "final_loss": records[-1]["loss"],
        # Over the sparse steps only (see above).
        "ratio_error_mean": _mean(errors),
        "ratio_error_mean_after_warmup": _mean(errors_after_warmup),
        "after_warmup_steps": [warmup, steps - 1],
        "selected_over_target_mean": _mean([r["selected"] / r["target"] for r in sparse]),
        "sparse_steps": len(sparse),
        # K/d over the whole run, a density warm-up included.
        "mean_density": fmean(r["selected"] / r["numel"] for r in records),
        # Σ K/d: how often an entry was sent over the run, on average (the residual holds the
        # rest; a short run at a low density sends each parameter about once, see SPARSIFIERS).
        "sends_per_entry": math.fsum(r["selected"] / r["numel"] for r in records),
        # Steps the hook averaged densely (min_speedup's probe, and its choice if dense).
        "dense_steps": sum(r.get("averaging") == "dense" for r in records),
        "traffic_ratio": sent / dense if dense else None,  # None: one worker sends nothing
        "seconds": {"wall": wall_seconds, "steps": step_total, **totals},
        "seconds_per_step": {part: total / steps for part, total in totals.items()},
    }


def format_summary(summary: dict[str, Any], out: Path) -> str:
    """A few human-readable lines for the end of a run."""
    config, per_step = summary["config"], summary["seconds_per_step"]
    traffic = summary["traffic_ratio"]
    shown = ", ".join(f"{_label(name)} {value:.4f}" for name, value in summary["metrics"].items())
    hook = config.get("ddp_hook", "microsparse")
    method = (
        f"{config['sparsifier']} at density {config['density']:g}"
        if hook == "microsparse"
        else f"DDP hook {hook}"
    )
    lines = [
        f"{summary['task']} / {summary['model']}: {method}, {config['world_size']} workers, "
        f"{config['integration']} integration: {summary['steps']} steps in "
        f"{summary['seconds']['wall']:.1f} s",
        f"  {shown}, final loss {summary['final_loss']:.4f}",
        _ratio_error_line(summary),
        f"  mean density K/d over the run: {summary['mean_density']:.3g} (an entry sent "
        f"{summary['sends_per_entry']:.3g} times in {summary['steps']} steps, on average); "
        "traffic vs dense all-reduce: "
        + ("n/a (1 worker)" if traffic is None else f"{100 * traffic:.2f} %"),
        *([_speed_line(summary)] if config.get("min_speedup") is not None else []),
        "  per step: "
        + ", ".join(
            f"{part} {1000 * per_step[part]:.1f} ms"
            for part in ("compute", "select", "exchange", "other")
        ),
        f"  wrote {out}/summary.json, metrics.jsonl, epochs.jsonl",
    ]
    return "\n".join(lines)


def _ratio_error_line(summary: dict[str, Any]) -> str:
    """The compression ratio error of the sparse steps, all of them and after the warm-up.

    Example:
        >>> print(_ratio_error_line({"ratio_error_mean": 0.01, "dense_steps": 9,
        ...       "ratio_error_mean_after_warmup": None, "after_warmup_steps": [10, 19]}))
          |K/k - 1| of the sparse steps (9 dense ones left out): 0.010 over all, n/a over steps 10-19
    """  # noqa: E501
    first, last = summary["after_warmup_steps"]
    means = [summary["ratio_error_mean"], summary["ratio_error_mean_after_warmup"]]
    every, later = ("n/a" if mean is None else f"{mean:.3f}" for mean in means)
    dense = summary.get("dense_steps", 0)
    if not dense:
        return f"  |K/k - 1|: {every} over all steps, {later} over steps {first}-{last}"
    return (
        f"  |K/k - 1| of the sparse steps ({dense} dense ones left out): {every} over all, "
        f"{later} over steps {first}-{last}"
    )


def _mean(values: list[float]) -> float | None:
    return fmean(values) if values else None


def _speed_line(summary: dict[str, Any]) -> str:
    """What the DDP hook's ``min_speedup`` chose, from what, and what it cost in dense steps.

    Example:
        >>> print(_speed_line({"config": {"min_speedup": 1.1}, "dense_steps": 5, "steps": 20,
        ...       "min_speedup": {"choice": "sparse", "medians": [[0.02, 0.05], [0.03, 0.05]]}}))
          min_speedup 1.1: chose sparse (median step, summed over ranks: sparse 50.0 ms, dense 100.0 ms); 5 of 20 steps averaged densely
    """  # noqa: E501
    speed = summary.get("min_speedup") or {}
    medians = speed.get("medians")
    line = f"  min_speedup {summary['config']['min_speedup']:g}: "
    if speed.get("choice") is None:
        line += "no choice yet (the run ended inside its probe)"
    else:
        line += f"chose {speed['choice']}"
    if medians:
        sparse, dense = (1000 * sum(row[i] for row in medians) for i in (0, 1))
        line += f" (median step, summed over ranks: sparse {sparse:.1f} ms, dense {dense:.1f} ms)"
    return line + f"; {summary['dense_steps']} of {summary['steps']} steps averaged densely"


def say(text: str) -> None:
    """Print a line of the run's report (clear of the progress bar); once stdout's reader has
    gone (``| head``), go on without printing: the run's files are its output."""
    try:
        tqdm.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()


def silence_stdout() -> None:
    """Point stdout at the null device, so that what is still buffered or written later is
    dropped instead of raising BrokenPipeError again (at exit, too)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _names(metrics: tuple[Metric, ...]) -> list[str]:
    return [metric.name for metric in metrics]


def _label(name: str) -> str:
    return name.replace("_", " ")


def _read_records(path: Path, key: str, before: int) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as file:
        records = [json.loads(line) for line in file if line.strip()]
    return [record for record in records if record[key] < before]


def json_safe(value: Any) -> Any:
    """Replace NaN and infinities (not valid JSON) by None, recursively; keys become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value
