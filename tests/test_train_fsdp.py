"""``microsparse train --integration fsdp``: the tasks on FSDP2, 2 replicas of 2 shards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FSDP_RUN = ("train", "--integration", "fsdp", "--workers", "4", "--shards", "2",
            "--no-progress")  # fmt: skip


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "microsparse_lab", *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


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


def test_sparse_averaging_across_replicas_sends_the_density(tmp_path) -> None:
    out = tmp_path / "lm"
    result = run_cli(*FSDP_RUN, "--task", "lm", "--density", "0.01", "--max-steps", "4",
                     "--model-option", "units=32", "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    steps = records(out)
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    for record in steps:
        assert record["selected"] == record["target"] > 0  # MiCRO's quotas: K = k exactly
        assert record["bytes_sent"] < 0.05 * record["dense_bytes"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metric"] == "valid_perplexity" and summary["metrics"]["valid_perplexity"] > 1


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
        (["--integration", "fsdp", "--checkpoint-every", "2"], "--checkpoint-every"),
        (["--integration", "fsdp", "--ddp-hook", "fp16"], "--ddp-hook"),
        (["--integration", "fsdp", "--one-exchange"], "--one-exchange"),
    ],
)
def test_what_fsdp_training_does_not_take_is_refused_by_name(args, option, tmp_path) -> None:
    result = run_cli("train", *args, "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert f"argument {option}:" in result.stderr
