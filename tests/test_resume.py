"""Checkpoint and exact resume: an interrupted and resumed run ends with the same parameters,
bit for bit, and the same metrics as an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distributed import run_ranks
from microsparse_lab.training import TrainConfig, checkpoint, train
from microsparse_lab.training.checkpoint import read_meta
from microsparse_lab.training.config import resume_config
from microsparse_lab.training.rundir import MARKER, ForeignFileError, claim
from tiny_datasets import write_cifar, write_ratings, write_wikitext

# LSTM: dropout (RNG) and a hidden state carried across steps; interrupted mid-epoch.
LM_LOOP = dict(
    task="lm",
    model_options={"units": 8, "layers": 2, "dropout": 0.3},
    batch_size=2,
    task_options={"bptt": 5},
    epochs=2,
)
SCENARIOS = {
    "lm-loop": LM_LOOP,
    # Adam correction: every worker's Adam moments, through the checkpoint.
    "lm-loop-adam": dict(LM_LOOP, optimizer="adam", lr=0.01, betas=(0.9, 0.999), clip=0.0,
                         adam_correction=True),  # fmt: skip
    # torch's PowerSGD hook: its error feedback, warm-start factors and RNG, saved after it
    # began to compress (step 3) and restored.
    "lm-ddp-powersgd": dict(LM_LOOP, integration="ddp", ddp_hook="powersgd(rank=1,start=3)"),
    # CIFAR: augmentation (RNG), momentum, warm-up; DDP's hook state. The model fits in one
    # DDP bucket: the hook's per-bucket message capacity makes a step depend on how DDP
    # grouped the parameters, and a fresh DDP model groups them differently in its first step.
    "cifar-ddp": dict(
        task="cifar10",
        model="smallcnn",
        model_options={"width": 4, "hidden": 32},
        batch_size=4,
        epochs=3,
        warmup_epochs=1,
        integration="ddp",
    ),
    # Momentum correction's velocities and a density warm-up interrupted while k still moves.
    "cifar-loop-mc-warmup": dict(
        task="cifar10",
        model="smallcnn",
        model_options={"width": 4, "hidden": 32},
        batch_size=4,
        epochs=2,
        momentum_correction=True,
        density_warmup=(0.2, 1.0),
    ),
    # NeuMF: dropout, the optimiser's Adam moments, negatives drawn per epoch.
    "recommendation-loop": dict(
        task="recommendation",
        adam_correction=False,
        model_options={"factors": 4, "mlp": [8, 4], "dropout": 0.5},
        batch_size=8,
        epochs=2,
    ),
}
DATA = {"lm": "wikitext", "cifar10": "cifar", "recommendation": "ratings"}
STOP = 7  # mid-epoch: each epoch has 10 to 35 steps


def interrupted_and_whole(rank: int, world_size: int, root: str) -> None:
    for name, options in SCENARIOS.items():
        options = dict(options, progress=False, density=0.01)
        options["data_dir"] = str(Path(root, DATA[options["task"]]))
        whole, parts = Path(root, name, "whole"), Path(root, name, "parts")
        for out in (whole, parts):
            out.mkdir(parents=True, exist_ok=True)
        train(TrainConfig(out=str(whole), checkpoint_every=1000, **options))
        train(TrainConfig(out=str(parts), checkpoint_every=3, max_steps=STOP, **options))
        # The interrupted run stopped at STOP on purpose: the resumed one runs to the end.
        train(resume_config(read_meta(parts)["config"], {"max_steps": None}, str(parts)))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    write_cifar(root / "cifar", 10, per_file=8)
    write_wikitext(root / "wikitext", repeat=40)
    write_ratings(root / "ratings", users=8, items=200, per_user=12)
    run_ranks(interrupted_and_whole, 2, root / "ranks", str(root))
    return root


def load(out: Path) -> dict:
    return torch.load(out / "checkpoint" / "shared.pt", weights_only=True)


def lines(path: Path, *keys: str) -> list[tuple]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [tuple(record[key] for key in keys) for record in records]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resumed_run_equals_uninterrupted_run_bitwise(root, name):
    whole, parts = root / name / "whole", root / name / "parts"
    final, resumed = load(whole), load(parts)
    assert resumed["position"] == final["position"]
    assert final["model"].keys() == resumed["model"].keys()
    for key, value in final["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    for key in ("step", "loss", "lr", "selected", "threshold"):
        assert lines(whole / "metrics.jsonl", key) == lines(parts / "metrics.jsonl", key), key
    metric = json.loads((whole / "summary.json").read_text())["metric"]
    epoch_keys = ("epoch", "steps", "train_loss", metric)
    assert lines(whole / "epochs.jsonl", *epoch_keys) == lines(parts / "epochs.jsonl", *epoch_keys)
    summary = json.loads((parts / "summary.json").read_text())
    assert summary["steps"] == final["position"]["step"]
    ranks = sorted(path.name for path in (parts / "checkpoint").glob("rank*.pt"))
    assert ranks == ["rank0.pt", "rank1.pt"]
    meta = json.loads((parts / "checkpoint" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["step"] == summary["steps"]


def test_saving_never_deletes_a_users_file_in_a_checkpoint_folder(tmp_path):
    """The guards under the command line's check: a checkpoint folder is deleted only when it
    holds nothing but checkpoint files, and a run claims only a directory without a user's
    run file."""
    for name in ("checkpoint", "checkpoint.new"):
        (tmp_path / name).mkdir()
        torch.save({}, tmp_path / name / "shared.pt")
        (tmp_path / name / "meta.json").write_text("{}")
    mine = tmp_path / "checkpoint" / "notes.txt"
    mine.write_text("mine")
    with pytest.raises(ForeignFileError, match=f"{mine} was not written by microsparse"):
        checkpoint.swap_in(tmp_path / "checkpoint")
    with pytest.raises(ForeignFileError, match="move notes.txt elsewhere"):
        checkpoint.remove_checkpoints(tmp_path)
    assert mine.read_text() == "mine" and (tmp_path / "checkpoint.new" / "shared.pt").exists()
    mine.unlink()
    checkpoint.remove_checkpoints(tmp_path)  # only checkpoint files: deleted
    assert sorted(path.name for path in tmp_path.iterdir()) == []
    (tmp_path / "summary.json").write_text("theirs")
    with pytest.raises(ForeignFileError, match=f"has no {MARKER} marker"):
        claim(tmp_path)
    (tmp_path / "summary.json").unlink()
    claim(tmp_path)
    assert (tmp_path / MARKER).is_file()
