"""The per-worker training loop: one rank of data-parallel training with a GradientReducer.

Rank 0 writes three files to ``config.out``: ``metrics.jsonl`` (one record per step),
``epochs.jsonl`` (test accuracy after every epoch) and ``summary.json``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from microsparse.ddp import SparseState, sparse_hook
from microsparse.reducer import GradientReducer
from microsparse.stats import StepStats
from microsparse.training.data import Split, load_mnist, shard_batches
from microsparse.training.models import build_model


@dataclass(frozen=True)
class TrainConfig:
    """One training run, as the ``microsparse train`` options describe it."""

    sparsifier: str = "micro"
    density: float = 0.001
    threshold_rule: str | None = None  # None: the sparsifier's own default
    epochs: int = 20
    batch_size: int = 32  # per worker
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 1  # model initialisation and data order; the train/test split is fixed
    out: str = "runs/train"
    device: str = "cpu"  # "cpu" or "cuda" (one GPU per local rank)
    max_steps: int | None = None  # stop after this many steps, even mid-epoch
    progress: bool = True  # tqdm bar on rank 0
    integration: str = "loop"  # "loop": GradientReducer; "ddp": DistributedDataParallel + hook

    def sparsifier_options(self) -> dict[str, Any]:
        return {} if self.threshold_rule is None else {"threshold_rule": self.threshold_rule}


def train(config: TrainConfig, local_rank: int = 0) -> None:
    """Train on this rank of an initialised process group; rank 0 writes the run's files.

    Every rank must call it with the same config.

    Example:
        >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29500",  # doctest: +SKIP
        ...                         rank=0, world_size=1)
        >>> train(TrainConfig(max_steps=5, out="runs/smoke"))  # doctest: +SKIP
    """
    started = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if config.device == "cuda" else torch.device("cpu")
    train_set, test_set = (split.to(device) for split in load_mnist())
    model = build_model(config.seed).to(device)
    for parameter in model.parameters():  # identical start on every rank, whatever its RNG did
        dist.broadcast(parameter.data, src=0)
    averaging = Averaging(model, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    steps_per_epoch = len(train_set.labels) // (config.batch_size * world_size)
    if steps_per_epoch == 0:
        raise ValueError(
            f"batch_size {config.batch_size} x {world_size} workers exceeds the "
            f"{len(train_set.labels)} training samples"
        )
    total_steps = config.epochs * steps_per_epoch
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    log = RunLog(config, total_steps) if rank == 0 else None

    step = 0
    for epoch in range(config.epochs):
        batches = shard_batches(
            len(train_set.labels), config.batch_size, rank, world_size, config.seed, epoch
        )
        for batch in batches[: total_steps - step].to(device):
            step_started = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(
                averaging.model(train_set.inputs[batch]), train_set.labels[batch]
            )
            loss.backward()
            _wait_for(device)
            compute_seconds = time.perf_counter() - step_started
            stats = averaging.synchronize()
            optimizer.step()
            mean_loss = _mean_over_ranks(loss.detach())
            step_seconds = time.perf_counter() - step_started
            if log:
                log.step(step, epoch, mean_loss, compute_seconds, step_seconds, stats)
            step += 1
        if log:
            log.epoch(epoch, step, *evaluate(model, test_set))
        dist.barrier()  # the other ranks wait while rank 0 evaluates
        if step == total_steps:
            break
    if log:
        log.finish(averaging.options(), world_size, time.perf_counter() - started)


class Averaging:
    """How gradients are averaged: ``GradientReducer`` after backward, or DDP's comm hook.

    With ``ddp`` the exchange overlaps the backward pass, so the step's compute time includes
    what of it was not hidden, and the statistics come from the hook's state.
    """

    def __init__(self, model: nn.Module, config: TrainConfig) -> None:
        self.model = model
        self._reducer: GradientReducer | None = None
        self._state: SparseState | None = None
        options = config.sparsifier_options()
        if config.integration == "ddp":
            self._state = SparseState(config.sparsifier, config.density, **options)
            self.model = DistributedDataParallel(model)
            self.model.register_comm_hook(self._state, sparse_hook)
        else:
            self._reducer = GradientReducer(
                model.named_parameters(), config.sparsifier, config.density, **options
            )

    def synchronize(self) -> StepStats:
        if self._reducer is not None:
            return self._reducer.synchronize()
        assert self._state is not None and self._state.last_step is not None
        return self._state.last_step

    def options(self) -> dict[str, Any]:
        if self._reducer is not None:
            return self._reducer.sparsifier.options()
        assert self._state is not None
        return {
            "threshold_rule": self._state.threshold_rule,
            "capacity_factor": self._state.capacity_factor,
        }


@torch.no_grad()
def evaluate(model: nn.Module, split: Split, batch_size: int = 500) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on ``split``.

    Example:
        >>> accuracy, loss = evaluate(model, test_set)  # doctest: +SKIP
    """
    model.eval()
    logits = torch.cat([model(chunk) for chunk in split.inputs.split(batch_size)])
    model.train()
    accuracy = (logits.argmax(dim=1) == split.labels).float().mean().item()
    return accuracy, F.cross_entropy(logits, split.labels).item()


def _mean_over_ranks(value: torch.Tensor) -> float:
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value.item() / dist.get_world_size()


def _wait_for(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: time them, not their launch
        torch.cuda.synchronize(device)


class RunLog:
    """Rank 0's output: progress bar, per-step and per-epoch JSON lines, and the summary."""

    def __init__(self, config: TrainConfig, total_steps: int) -> None:
        self.config = config
        self.out = Path(config.out)
        self.records: list[dict[str, Any]] = []
        self.epochs: list[dict[str, Any]] = []
        for stale in ("summary.json", "error.log"):  # left by an earlier run into this directory
            (self.out / stale).unlink(missing_ok=True)
        # Line-buffered, so that an interrupted run still leaves every finished step on disk.
        self._metrics = open(self.out / "metrics.jsonl", "w", buffering=1, encoding="utf-8")
        self._epoch_file = open(self.out / "epochs.jsonl", "w", buffering=1, encoding="utf-8")
        self._epoch_started = time.perf_counter()
        self._bar = tqdm(
            total=total_steps, unit="step", dynamic_ncols=True, disable=not config.progress
        )

    def step(
        self,
        step: int,
        epoch: int,
        loss: float,
        compute_seconds: float,
        step_seconds: float,
        stats: StepStats,
    ) -> None:
        record = {
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "compute_seconds": compute_seconds,
            "step_seconds": step_seconds,
            **stats.as_record(),
        }
        self.records.append(record)
        self._metrics.write(json.dumps(_json_safe(record)) + "\n")
        self._bar.set_postfix(
            {
                "loss": f"{loss:.3f}",
                "density": f"{stats.density:.2e}",
                "K/k": f"{stats.selected / stats.target:.2f}",
            },
            refresh=False,
        )
        self._bar.update()

    def epoch(self, epoch: int, steps: int, test_accuracy: float, test_loss: float) -> None:
        losses = [r["loss"] for r in self.records if r["epoch"] == epoch]
        now = time.perf_counter()
        record = {
            "epoch": epoch,
            "steps": steps,
            "train_loss": fmean(losses),
            "test_accuracy": test_accuracy,
            "test_loss": test_loss,
            "seconds": now - self._epoch_started,
        }
        self._epoch_started = now
        self.epochs.append(record)
        self._epoch_file.write(json.dumps(_json_safe(record)) + "\n")
        tqdm.write(
            f"epoch {epoch}: train loss {record['train_loss']:.4f}, "
            f"test accuracy {test_accuracy:.4f}, {record['seconds']:.1f} s"
        )

    def finish(self, options: dict[str, Any], world_size: int, wall_seconds: float) -> None:
        self._bar.close()
        self._metrics.close()
        self._epoch_file.close()
        summary = summarize(self.config, self.records, self.epochs, wall_seconds)
        summary["config"].update(world_size=world_size, sparsifier_options=options)
        summary.update(parameters=self.records[-1]["numel"], target=self.records[-1]["target"])
        (self.out / "summary.json").write_text(json.dumps(_json_safe(summary), indent=2) + "\n")
        print(format_summary(summary, self.out))


def summarize(
    config: TrainConfig,
    records: list[dict[str, Any]],
    epochs: list[dict[str, Any]],
    wall_seconds: float,
) -> dict[str, Any]:
    """The run's headline numbers from its step and epoch records (see ``summary.json``).

    Timings are rank 0's. The first half of the steps counts as warm-up for the compression
    ratio error, because the threshold controller moves by at most 0.5 % per step.

    Example:
        >>> summary = summarize(config, log.records, log.epochs, 60.0)  # doctest: +SKIP
        >>> summary["traffic_ratio"], summary["test_accuracy"]         # doctest: +SKIP
    """
    steps = len(records)  # at least 1: train() runs at least one step
    warmup = steps // 2
    errors = [r["ratio_error"] for r in records]
    step_total = math.fsum(r["step_seconds"] for r in records)
    totals = {
        part: math.fsum(r[f"{part}_seconds"] for r in records)
        for part in ("compute", "select", "exchange")
    }
    # Under DDP the hook's selection and exchange run inside backward (timed as compute).
    inside = 0.0 if config.integration == "ddp" else totals["select"] + totals["exchange"]
    totals["other"] = step_total - totals["compute"] - inside
    sent, dense = (sum(r[key] for r in records) for key in ("bytes_sent", "dense_bytes"))
    return {
        "config": asdict(config),
        "steps": steps,
        "epochs": len(epochs),
        "test_accuracy": epochs[-1]["test_accuracy"],
        "test_accuracy_per_epoch": [e["test_accuracy"] for e in epochs],
        "final_loss": records[-1]["loss"],
        "ratio_error_mean": fmean(errors),
        "ratio_error_mean_after_warmup": fmean(errors[warmup:]),
        "after_warmup_steps": [warmup, steps - 1],
        "selected_over_target_mean": fmean(r["selected"] / r["target"] for r in records),
        "traffic_ratio": sent / dense if dense else None,  # None: one worker sends nothing
        "seconds": {"wall": wall_seconds, "steps": step_total, **totals},
        "seconds_per_step": {part: total / steps for part, total in totals.items()},
    }


def format_summary(summary: dict[str, Any], out: Path) -> str:
    """A few human-readable lines for the end of a run."""
    config, per_step = summary["config"], summary["seconds_per_step"]
    traffic = summary["traffic_ratio"]
    first, last = summary["after_warmup_steps"]
    lines = [
        f"{config['sparsifier']} at density {config['density']:g}, {config['world_size']} "
        f"workers, {config['integration']} integration: {summary['steps']} steps in "
        f"{summary['seconds']['wall']:.1f} s",
        f"  test accuracy {summary['test_accuracy']:.4f}, final loss {summary['final_loss']:.4f}",
        f"  |K/k - 1|: {summary['ratio_error_mean']:.3f} over all steps, "
        f"{summary['ratio_error_mean_after_warmup']:.3f} over steps {first}-{last}",
        "  traffic vs dense all-reduce: "
        + ("n/a (1 worker)" if traffic is None else f"{100 * traffic:.2f} %"),
        "  per step: "
        + ", ".join(
            f"{part} {1000 * per_step[part]:.1f} ms"
            for part in ("compute", "select", "exchange", "other")
        ),
        f"  wrote {out}/summary.json, metrics.jsonl, epochs.jsonl",
    ]
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    """Replace NaN and infinities (not valid JSON) by None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value
