"""One short data-parallel run per task on 2 real gloo ranks, in one spawned process group,
and the gradient-capture files."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from distributed import run_ranks
from microsparse.engine import dense_stats
from microsparse_lab.training import TrainConfig, train
from microsparse_lab.training.pending import PendingSteps, TrainingDiverged
from tiny_datasets import write_cifar, write_ratings, write_wikitext

TINY_LSTM = {"units": 8, "layers": 1, "dropout": 0.0}
RUNS = {
    "mnist": dict(task="mnist", max_steps=3, capture_steps=2),
    "cifar10": dict(task="cifar10", model="smallcnn", batch_size=4, epochs=2),
    "lm": dict(task="lm", model_options=TINY_LSTM, batch_size=2, task_options={"bptt": 5}),
    "lm-ddp": dict(
        task="lm",
        model_options=TINY_LSTM,
        batch_size=2,
        task_options={"bptt": 5},
        integration="ddp",
    ),
    "recommendation": dict(
        task="recommendation",
        model_options={"factors": 4, "mlp": [8, 4]},
        batch_size=16,
        epochs=2,
    ),
}


def run_every_task(rank: int, world_size: int, root: str) -> None:
    for name, options in RUNS.items():
        options = dict(options)
        if options["task"] == "cifar10":
            options["data_dir"] = str(Path(root, "cifar"))
        if options["task"] == "lm":
            options.update(data_dir=str(Path(root, "wikitext")), epochs=2)
        if options["task"] == "recommendation":
            options["data_dir"] = str(Path(root, "ratings"))
        if name == "mnist":
            options["capture_gradients"] = str(Path(root, "grads"))
        out = Path(root, name)
        out.mkdir(exist_ok=True)
        train(TrainConfig(out=str(out), progress=False, density=0.01, **options))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    write_cifar(root / "cifar", 10, per_file=8)
    write_wikitext(root / "wikitext", repeat=40)
    write_ratings(root / "ratings", users=10, items=300, per_user=20)
    run_ranks(run_every_task, 2, root / "ranks", str(root))
    return root


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("name", list(RUNS))
def test_every_task_trains_and_reports_its_metrics(runs, name):
    out = runs / name
    summary = json.loads((out / "summary.json").read_text())
    steps, epochs = read_lines(out / "metrics.jsonl"), read_lines(out / "epochs.jsonl")
    assert summary["task"] == RUNS[name]["task"] and summary["steps"] == len(steps) > 0
    assert [r["step"] for r in steps] == list(range(len(steps)))
    assert all(r["world_size"] == 2 and r["lr"] > 0 for r in steps)
    names = summary["metric_names"]
    for record in epochs:
        assert record["metric"] == names[0] and record["value"] == record[names[0]]
    for metric in names:
        assert summary[metric] == summary["metrics"][metric] == epochs[-1][metric]
        assert summary[f"{metric}_per_epoch"] == [e[metric] for e in epochs]
    expected = {
        "mnist": ["test_accuracy"],
        "cifar10": ["test_accuracy"],
        "lm": ["valid_perplexity"],
        "lm-ddp": ["valid_perplexity"],
        "recommendation": ["hr@10", "ndcg@10"],
    }[name]
    assert names == expected
    if name.startswith("lm"):
        assert summary["higher_is_better"] is False and summary["valid_perplexity"] > 1
        assert len(epochs) == 2 and summary["config"]["clip"] == 0.4
    else:
        assert all(0 <= summary[metric] <= 1 for metric in names)
    assert summary["config"]["integration"] == ("ddp" if name == "lm-ddp" else "loop")


def test_captured_gradients_are_each_ranks_local_flat_gradient(runs):
    directory = runs / "grads"
    layout = json.loads((directory / "layout.json").read_text())
    assert layout["task"] == "mnist" and layout["model"] == "smallcnn"
    assert layout["names"][0] == "features.0.weight" and layout["offsets"][0] == 0
    sizes = [int(torch.tensor(shape).prod()) for shape in layout["shapes"]]
    assert layout["offsets"] == [sum(sizes[:i]) for i in range(len(sizes))]
    assert layout["numel"] == sum(sizes)
    files = sorted(path.name for path in directory.glob("grad-*.pt"))
    assert files == [f"grad-rank{r}-step{s:06d}.pt" for r in (0, 1) for s in (0, 1)]
    grads = {name: torch.load(directory / name, weights_only=True) for name in files}
    for gradient in grads.values():
        assert gradient.dtype == torch.float32 and gradient.shape == (layout["numel"],)
        assert torch.isfinite(gradient).all() and gradient.abs().sum() > 0
    # Before averaging, ranks see different batches: their gradients differ.
    assert not torch.equal(grads["grad-rank0-step000000.pt"], grads["grad-rank1-step000000.pt"])


READ_LATE = {  # the Pending numbers of each driver and framing, read steps after they were made
    "loop": dict(),
    "hook": dict(integration="ddp"),
    "hook, fixed top-k": dict(integration="ddp", sparsifier="topk", wire="fixed"),
    "loop, threshold": dict(selection="threshold"),
}
TIMES = ("compute_seconds", "step_seconds", "select_seconds", "exchange_seconds")


def train_reading_every(rank: int, world_size: int, root: str) -> None:
    for name, options in READ_LATE.items():
        for every in (1, 4):
            out = Path(root, f"{name}-{every}")
            train(TrainConfig(task="mnist", max_steps=10, progress=False, log_every=every,
                              out=str(out), **options))  # fmt: skip
    resumed = f"{root}/resumed"  # checkpointed reading every step, resumed reading every 3
    train(TrainConfig(task="mnist", max_steps=6, progress=False, checkpoint_every=3, out=resumed))
    train(TrainConfig(task="mnist", max_steps=9, progress=False, checkpoint_every=3, log_every=3,
                      resume=True, out=resumed))  # fmt: skip
    for every in (1, 4):  # overflows at once: stops on every rank, before any checkpoint
        out = f"{root}/nan-{every}"
        config = TrainConfig(task="mnist", max_steps=10, progress=False, lr=1e30,
                             log_every=every, checkpoint_every=4, out=out)  # fmt: skip
        try:
            train(config)
        except Exception as error:  # noqa: BLE001 - what it was is the result
            Path(root, f"nan-{every}-rank{rank}.txt").write_text(f"{type(error).__name__}: {error}")


@pytest.fixture(scope="module")
def read_late(tmp_path_factory):
    root = tmp_path_factory.mktemp("every")
    run_ranks(train_reading_every, 2, root / "ranks", str(root))
    return root


@pytest.mark.parametrize("name", list(READ_LATE))
def test_steps_read_every_n_record_what_each_step_read_at_once_records(read_late, name):
    """--log-every reads a step's device numbers steps later: what it records must be what
    that step made, not what the buffers hold by then (times aside; the mean loss to its last
    bits, one all-reduce of several losses against one each)."""
    at_once = read_lines(read_late / f"{name}-1" / "metrics.jsonl")
    later = read_lines(read_late / f"{name}-4" / "metrics.jsonl")
    assert [r["step"] for r in later] == list(range(10))
    moving = "selected" if "top-k" in name else "threshold"  # a number each step changes
    assert len({r[moving] for r in later}) > 1
    for first, second in zip(at_once, later, strict=True):
        assert second["loss"] == pytest.approx(first["loss"], rel=1e-6)
        assert all(second[t] >= 0 for t in TIMES)
        same = {k: v for k, v in first.items() if k not in (*TIMES, "loss")}
        assert {k: second[k] for k in same} == same
    summaries = [json.loads((read_late / f"{name}-{e}" / "summary.json").read_text())
                 for e in (1, 4)]  # fmt: skip
    assert summaries[0]["test_accuracy"] == summaries[1]["test_accuracy"]
    assert summaries[1]["config"]["log_every"] == 4


def test_a_diverged_run_stops_on_every_rank_before_a_checkpoint_whatever_it_reads(read_late):
    """On the CPU the library's own check raises at the step, whatever the loop reads; no
    checkpoint holds NaN weights. (On a GPU the check stays on the device and the loop stops
    at its next read: test_pending_steps_stop_a_diverged_run_on_every_rank.)"""
    for every in (1, 4):
        said = {(read_late / f"nan-{every}-rank{r}.txt").read_text() for r in (0, 1)}
        assert len(said) == 1 and next(iter(said)).startswith("NonFiniteGradientError"), said
        assert not (read_late / f"nan-{every}" / "checkpoint").exists()


def test_a_run_resumes_reading_at_another_cadence(read_late):
    """log_every changes only when the host reads: a run checkpointed reading every step
    resumes reading every 3 and records what the uninterrupted run did."""
    resumed = read_lines(read_late / "resumed" / "metrics.jsonl")
    whole = read_lines(read_late / "loop-1" / "metrics.jsonl")[:9]
    assert [r["step"] for r in resumed] == list(range(9))
    for first, second in zip(whole, resumed, strict=True):
        assert {k: second[k] for k in first if k not in TIMES} == {
            k: v for k, v in first.items() if k not in TIMES
        }


def diverging_steps(rank: int, n: int, case: str) -> str:
    pending = PendingSteps(every=4, device=torch.device("cpu"), log=None, check_finite=True)
    for step in range(4):
        stats = dense_stats(step, 10, n, target=10, bytes_sent=0, dense_bytes=0)
        nan = case == "loss" and rank == 1 and step == 2
        if case == "gradient" and step == 1:
            stats = dataclasses.replace(stats, skipped=True)
        try:
            pending.add(step, 0, torch.tensor(math.nan if nan else 1.0), 0.1, (0.0, 0.0, 0.0),
                        stats)  # fmt: skip
        except TrainingDiverged as error:
            return f"step {step}: {error}"
    return "went on"


@pytest.mark.parametrize(
    ("case", "said"),
    [("loss", "step 3: step 2: the loss"), ("gradient", "step 3: step 1: the gradient")],
)
def test_pending_steps_stop_a_diverged_run_on_every_rank(case, said, tmp_path):
    """A NaN loss on one rank, or a step the library skipped for a non-finite gradient (its
    sync-free "skip"): every rank raises at the read after it (the 4th step), naming it."""
    for result in run_ranks(diverging_steps, 2, tmp_path, case):
        assert result.startswith(said), result
