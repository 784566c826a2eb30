"""``microsparse train --integration fsdp``: the tasks on FSDP2, 2 replicas of 2 shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

FSDP_RUN = ("train", "--integration", "fsdp", "--workers", "4", "--shards", "2",
            "--no-progress")  # fmt: skip


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "microsparse_lab", *args], capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_density_1_trains_exactly_as_fsdps_own_hybrid_sharding(tmp_path) -> None:
    runs = {}
    for name, options in (("ours", ("--density", "1")), ("hsdp", ("--sparsifier", "dense"))):
        out = tmp_path / name
        result = run_cli(*FSDP_RUN, "--max-steps", "6", "--out", str(out), *options)
        assert result.returncode == 0, result.stderr
        runs[name] = (records(out), json.loads((out / "summary.json").read_text()))
    (ours, our_summary), (hsdp, hsdp_summary) = runs["ours"], runs["hsdp"]
    # Powers of two: the replicas' and the shards' divisions are exact in either order.
    assert [r["loss"] for r in ours] == [r["loss"] for r in hsdp]
    assert our_summary["test_accuracy"] == hsdp_summary["test_accuracy"]
    assert our_summary["config"]["integration"] == "fsdp"
    assert all(r["bytes_sent"] == r["dense_bytes"] for r in hsdp)


@pytest.mark.parametrize("exchange", [(), ("--one-exchange",)], ids=["per module", "one"])
def test_sparse_averaging_across_replicas_sends_the_density(exchange, tmp_path) -> None:
    out = tmp_path / "lm"
    result = run_cli(*FSDP_RUN, "--task", "lm", "--density", "0.01", "--max-steps", "4",
                     "--model-option", "units=32", "--out", str(out), *exchange)  # fmt: skip
    assert result.returncode == 0, result.stderr
    steps = records(out)
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    for record in steps:
        assert record["selected"] == record["target"] > 0  # MiCRO's quotas: K = k exactly
        assert record["bytes_sent"] < 0.05 * record["dense_bytes"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metric"] == "valid_perplexity" and summary["metrics"]["valid_perplexity"] > 1
    assert summary["config"]["one_exchange"] == bool(exchange)


def test_shards_that_do_not_divide_the_ranks_are_named(tmp_path) -> None:
    out = str(tmp_path / "run")
    result = run_cli("train", "--integration", "fsdp", "--workers", "2", "--shards", "3",
                     "--max-steps", "1", "--no-progress", "--out", out)  # fmt: skip
    assert result.returncode != 0
    assert "shards: 3 ranks per replica do not divide the 2 ranks" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--shards", "2"], "--shards"),  # an option of --integration fsdp
        (["--integration", "fsdp", "--ddp-hook", "fp16"], "--ddp-hook"),
        (["--integration", "fsdp", "--sparsifier", "dense", "--one-exchange"], "--one-exchange"),
    ],
)
def test_what_fsdp_training_does_not_take_is_refused_by_name(args, option, tmp_path) -> None:
    result = run_cli("train", *args, "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert f"argument {option}:" in result.stderr


# 4 steps an epoch (4,000 digits, 4 x 250 a step), 2 epochs: stopped at step 5, mid-epoch,
# after an evaluation and a checkpoint at step 3 that the last one replaces.
SHORT_EPOCHS = ("--batch-size", "250", "--epochs", "2")
SPARSIFIERS = {"micro": (), "dense": ("--sparsifier", "dense")}  # dense: hybrid sharding


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> Path:
    """Per sparsifier, a whole run (``whole``) and one stopped and resumed (``parts``)."""
    root = tmp_path_factory.mktemp("fsdp-resume")
    for name, options in SPARSIFIERS.items():
        whole, parts = root / name / "whole", root / name / "parts"
        runs = [
            (*FSDP_RUN, *SHORT_EPOCHS, *options, "--checkpoint-every", "1000", "--out", str(whole)),
            (*FSDP_RUN, *SHORT_EPOCHS, *options, "--checkpoint-every", "3", "--max-steps", "5",
             "--out", str(parts)),
            ("train", "--resume", str(parts), "--max-steps", "8", "--no-progress"),
        ]  # fmt: skip
        for args in runs:
            result = run_cli(*args)
            assert result.returncode == 0, result.stderr
    return root


def consolidated(out: Path) -> dict:
    """The model and optimiser state of the DCP checkpoint in ``out``, unsharded."""
    whole = out.with_name(out.name + "-consolidated.pt")
    dcp_to_torch_save(out / "checkpoint", whole)
    return torch.load(whole, weights_only=False)


def lines(path: Path, *keys: str) -> list[tuple]:
    return [tuple(json.loads(line).get(key) for key in keys)
            for line in path.read_text().splitlines()]  # fmt: skip


@pytest.mark.parametrize("name", list(SPARSIFIERS))
def test_a_resumed_fsdp_run_equals_an_uninterrupted_one_bitwise(resumed, name) -> None:
    whole, parts = resumed / name / "whole", resumed / name / "parts"
    for key in ("step", "loss", "lr", "selected", "threshold"):
        assert lines(whole / "metrics.jsonl", key) == lines(parts / "metrics.jsonl", key), key
    epoch_keys = ("epoch", "steps", "train_loss", "test_accuracy")
    assert lines(whole / "epochs.jsonl", *epoch_keys) == lines(parts / "epochs.jsonl", *epoch_keys)
    final, again = consolidated(whole), consolidated(parts)
    assert final["model"].keys() == again["model"].keys()
    for key, value in final["model"].items():
        assert torch.equal(value, again["model"][key]), key
    for key, value in final["optimizer"]["state"].items():  # SGD's momentum buffers
        for slot, tensor in value.items():
            assert torch.equal(tensor, again["optimizer"]["state"][key][slot]), (key, slot)
    meta = json.loads((parts / "checkpoint" / "meta.json").read_text())
    assert meta["step"] == 8 and meta["world_size"] == 4
    assert meta["mesh"] == {"replicate": 2, "shard": 2}


def test_resuming_on_other_shards_is_refused_with_the_fix(resumed, tmp_path) -> None:
    parts = str(resumed / "micro" / "parts")
    result = run_cli("train", "--resume", parts, "--shards", "1", "--no-progress")
    assert result.returncode == 2
    assert "argument --shards: cannot change when resuming (the checkpoint has 2)" in result.stderr
    other = run_cli("train", "--resume", parts, "--sparsifier", "dense", "--no-progress")
    assert "argument --sparsifier: cannot change when resuming" in other.stderr
    # --shards left out: the ranks per machine, which may differ when the run resumes.
    out = str(tmp_path / "per-machine")
    result = run_cli("train", "--integration", "fsdp", "--workers", "4", "--max-steps", "1",
                     "--checkpoint-every", "1", "--no-progress", "--out", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    two_per_machine = {**os.environ, "LOCAL_WORLD_SIZE": "2"}
    result = run_cli("train", "--resume", out, "--max-steps", "2", "--no-progress",
                     env=two_per_machine)  # fmt: skip
    assert result.returncode == 1
    assert ("sharded with --shards 1 (4 replicas), this run's with --shards 2" in result.stderr
            and "resume with --shards 1 and 4 ranks" in result.stderr), result.stderr  # fmt: skip
