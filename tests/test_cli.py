"""``microsparse train``: a real two-worker run, and clean refusals of bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from microsparse.cli import main

STEP_FIELDS = {
    "step", "epoch", "loss", "compute_seconds", "selected", "target", "density",
    "target_density", "threshold", "local_selected", "partition", "bytes_sent", "dense_bytes",
    "select_seconds", "exchange_seconds", "ratio_error", "padding_overhead", "traffic_ratio",
}  # fmt: skip
SUMMARY_FIELDS = {
    "config", "steps", "test_accuracy", "final_loss", "ratio_error_mean",
    "ratio_error_mean_after_warmup", "after_warmup_steps", "traffic_ratio", "seconds",
    "seconds_per_step",
}  # fmt: skip


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "microsparse", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("integration", ["loop", "ddp"])
def test_two_worker_run_writes_a_record_per_step_and_a_summary(integration, tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train",
        "--workers",
        "2",
        "--max-steps",
        "5",
        "--no-progress",
        "--out",
        str(out),
        "--integration",
        integration,
    )
    assert result.returncode == 0, result.stderr

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    for record in records:
        assert STEP_FIELDS <= record.keys()
        assert record["world_size"] == 2 and record["epoch"] == 0
        assert 0 < record["selected"] and 0 < record["bytes_sent"] <= record["dense_bytes"]
    # The DDP hook's first pass is dense; from then on both integrations send less.
    assert all(r["bytes_sent"] < r["dense_bytes"] for r in records[1:])

    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_FIELDS <= summary.keys()
    assert summary["steps"] == 5
    assert summary["config"]["world_size"] == 2 and summary["config"]["sparsifier"] == "micro"
    assert summary["config"]["integration"] == integration
    assert 0 <= summary["test_accuracy"] <= 1
    assert 0 < summary["traffic_ratio"] < 1
    assert summary["final_loss"] == records[-1]["loss"]
    assert summary["after_warmup_steps"] == [2, 4]
    assert summary["seconds"]["wall"] > sum(r["compute_seconds"] for r in records) > 0
    assert len((out / "epochs.jsonl").read_text().splitlines()) == 1
    assert "test accuracy" in result.stdout


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--density", "0"], "--density"),
        (["--density", "nan"], "--density"),
        (["--density", "2"], "--density"),
        (["--sparsifier", "nope"], "--sparsifier"),
        (["--workers", "0"], "--workers"),
        (["--epochs", "0"], "--epochs"),
        (["--lr", "-0.1"], "--lr"),
        (["--momentum", "1"], "--momentum"),
        (["--batch-size", "4000"], "--batch-size"),
        (["--integration", "ddp", "--sparsifier", "sage"], "--sparsifier"),
    ],
)
def test_bad_option_exits_2_naming_the_option(args, option, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *args, "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert f"argument {option}:" in capsys.readouterr().err


def test_bad_option_from_the_command_line_has_no_traceback():
    result = run_cli("train", "--density", "0", "--no-progress")
    assert result.returncode == 2
    assert "argument --density:" in result.stderr
    assert "Traceback" not in result.stderr


def test_workers_must_agree_with_torchrun(monkeypatch, capsys, tmp_path):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--workers", "3", "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert "argument --workers: 3 disagrees with torchrun's WORLD_SIZE=2" in capsys.readouterr().err


def test_failing_worker_is_reported_in_one_line_without_traceback(tmp_path):
    out = tmp_path / "run"
    # A learning rate this large overflows the weights at once: the reducer then refuses the
    # non-finite gradient on every rank.
    result = run_cli(
        "train", "--workers", "2", "--lr", "1e30", "--max-steps", "5", "--no-progress",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("microsparse train: error: rank ")
    assert "NonFiniteGradientError" in last_line
    assert "Traceback" not in result.stderr
    assert "Traceback" in (out / "error.log").read_text()
