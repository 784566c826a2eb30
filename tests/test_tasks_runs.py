"""One short data-parallel run per task on 2 real gloo ranks, in one spawned process group,
and the gradient-capture files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distributed import run_ranks
from microsparse_lab.training import TrainConfig, train
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
