"""``microsparse report`` and ``compare``: tables and plots from run files, clean refusals."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from microsparse.stats import StepStats
from microsparse_lab.cli import main
from microsparse_lab.reports import load_run, load_runs, results_table
from microsparse_lab.reports import tensorboard as tensorboard_module
from microsparse_lab.reports.seeds import load_study

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOT_FILES = ["metric_vs_epoch", "metric_vs_time", "density_vs_step", "time_breakdown"]
STEPS_PER_EPOCH = 4


def write_run(
    directory: Path,
    sparsifier: str,
    metric: str,
    values: list[float],
    summary_metric: object = None,
) -> Path:
    """A run directory in the format ``microsparse train`` writes, with made-up numbers."""
    directory.mkdir(parents=True)
    numel, workers = 10_000, 2
    target = numel if sparsifier == "dense" else 10
    steps, epochs = [], []
    for step in range(STEPS_PER_EPOCH * len(values)):
        selected = target + (step % 3)
        stats = StepStats(
            step=step, numel=numel, world_size=workers, selected=selected, target=target,
            threshold=0.1, local_selected=selected // 2, max_local_selected=selected // 2 + 1,
            partition=None, bytes_sent=8 * selected, dense_bytes=4 * numel,
            select_seconds=0.002, exchange_seconds=0.003,
        )  # fmt: skip
        record = {"step": step, "epoch": step // STEPS_PER_EPOCH, "loss": 1.0 / (step + 1)}
        record.update(compute_seconds=0.01, step_seconds=0.016, **stats.as_record())
        steps.append(record)
    for epoch, value in enumerate(values):
        steps_done = STEPS_PER_EPOCH * (epoch + 1)
        epochs.append(
            {"epoch": epoch, "steps": steps_done, "metric": metric, "value": value, metric: value}
            | {"seconds": 2.0}
        )
    (directory / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (directory / "epochs.jsonl").write_text("".join(json.dumps(e) + "\n" for e in epochs))
    summary = {
        "config": {"sparsifier": sparsifier, "density": 0.001, "world_size": workers},
        "task": "made-up",
        "metric": metric if summary_metric is None else summary_metric,
        "steps": len(steps),
        "seconds": {"wall": 2.0 * len(values)},
    }
    (directory / "summary.json").write_text(json.dumps(summary))
    return directory


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as file:
        return list(csv.DictReader(file))


def test_report_writes_a_table_row_per_run_and_the_plots(tmp_path, capsys):
    runs = tmp_path / "runs"
    write_run(runs / "dense", "dense", "test_accuracy", [0.6, 0.8, 0.9])
    write_run(runs / "topk", "topk", "test_accuracy", [0.5, 0.7, 0.8])
    write_run(runs / "micro", "micro", "test_accuracy", [0.5, 0.86, 0.9])
    out = tmp_path / "report"

    assert main(["report", str(runs), "--out", str(out)]) == 0

    rows = read_csv(out / "results.csv")
    assert [row["run"] for row in rows] == ["dense", "micro", "topk"]
    for column in ("final_metric", "epochs_to_target", "seconds_to_target", "mean_density",
                   "ratio_error", "build_up", "bytes_per_step", "compute_ms", "select_ms",
                   "exchange_ms"):  # fmt: skip
        assert column in rows[0]
    by_run = {row["run"]: row for row in rows}
    # Default target: 95 % of dense's final 0.9 = 0.855, first reached in epoch 2 (4 s).
    assert float(by_run["micro"]["target"]) == pytest.approx(0.855)
    assert by_run["micro"]["epochs_to_target"] == "2"
    assert float(by_run["micro"]["seconds_to_target"]) == pytest.approx(4.0)
    assert by_run["topk"]["epochs_to_target"] == ""  # never reached
    # Steps and bytes to the target: every step of the first two epochs, 8 bytes a selection.
    micro_steps = 2 * STEPS_PER_EPOCH
    assert by_run["micro"]["steps_to_target"] == str(micro_steps)
    assert float(by_run["micro"]["bytes_to_target"]) == sum(
        8 * (10 + step % 3) for step in range(micro_steps)
    )
    assert by_run["topk"]["steps_to_target"] == by_run["topk"]["bytes_to_target"] == ""
    assert by_run["dense"]["metric"] == "test_accuracy"
    assert float(by_run["micro"]["build_up"]) == pytest.approx(1.1, abs=0.01)
    markdown = (out / "results.md").read_text()
    assert "final test_accuracy (higher is better)" in markdown
    assert markdown.count("| micro |") == 2  # quality table and cost table
    for name in PLOT_FILES:
        assert (out / f"{name}.png").read_bytes().startswith(PNG_MAGIC)
    assert "95% of the dense run's final test_accuracy" in capsys.readouterr().out


def test_lower_is_better_metric_sets_the_target_above_dense(tmp_path):
    write_run(tmp_path / "dense", "dense", "valid_perplexity", [300.0, 200.0, 150.0])
    write_run(tmp_path / "micro", "micro", "valid_perplexity", [400.0, 170.0, 155.0])
    table = results_table(load_runs([tmp_path]))
    assert table.metric.name == "valid_perplexity" and not table.metric.higher_is_better
    assert table.target.value == pytest.approx(157.5)
    micro = next(row for row in table.rows if row["run"] == "micro")
    assert micro["epochs_to_target"] == 3
    assert micro["best_metric"] == 155.0


def test_target_fraction_is_of_the_dense_run(tmp_path):
    runs = tmp_path / "runs"
    dense = load_run(write_run(runs / "dense", "dense", "test_accuracy", [0.6, 0.8, 1.0]))
    micro = load_run(write_run(runs / "micro", "micro", "test_accuracy", [0.5, 0.9, 0.97]))
    table = results_table([dense, micro], fraction=0.98)
    assert table.target.value == pytest.approx(0.98)
    assert table.target.source == "98% of the dense run's final test_accuracy"
    assert [row["epochs_to_target"] for row in table.rows] == [3, None]


def test_metric_named_by_the_summary_wins_and_given_target_is_used(tmp_path):
    declared = {"name": "ndcg@10", "value": 0.3, "higher_is_better": True}
    run = write_run(tmp_path / "micro", "micro", "ndcg@10", [0.1, 0.3], summary_metric=declared)
    epochs = [json.loads(line) for line in (run / "epochs.jsonl").read_text().splitlines()]
    # hr@10 comes first among known names: only the summary makes ndcg@10 the headline.
    (run / "epochs.jsonl").write_text(
        "".join(json.dumps(e | {"hr@10": 0.9}) + "\n" for e in epochs)
    )
    table = results_table(load_runs([run]), target=0.25)
    assert table.metric.name == "ndcg@10"
    assert table.target.source.startswith("given")
    assert table.rows[0]["epochs_to_target"] == 2


def test_unfinished_run_without_summary_is_reported_from_its_epochs(tmp_path):
    run = write_run(tmp_path / "micro", "micro", "hr@10", [0.2, 0.4])
    (run / "summary.json").unlink()
    table = results_table(load_runs([run]))
    assert table.metric.name == "hr@10" and table.metric.higher_is_better
    assert table.rows[0]["final_metric"] == 0.4 and table.rows[0]["run"] == "micro"


def test_tensorboard_events_or_a_clear_message(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "micro", "micro", "test_accuracy", [0.5, 0.9])
    logdir = tmp_path / "tb"
    if tensorboard_module.tensorboard_available():
        assert main(["report", str(run), "--no-plots", "--tensorboard", str(logdir)]) == 0
        assert list((logdir / "micro").glob("events.out.tfevents.*"))
    monkeypatch.setattr(tensorboard_module, "tensorboard_available", lambda: False)
    capsys.readouterr()
    assert main(["report", str(run), "--no-plots", "--tensorboard", str(logdir)]) == 2
    assert "pip install tensorboard" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: d.mkdir(), "has no metrics.jsonl"),
        (lambda d: None, "is not a directory"),
        (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text("")), "has no step records"),
        (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text("{\n{}\n")), "not valid JSON"),
    ],
)
def test_report_refuses_missing_or_empty_runs_in_one_line(tmp_path, capsys, setup, message):
    run = tmp_path / "run"
    setup(run)
    assert main(["report", str(run)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("microsparse report: error: ")
    assert message in error[0]


def test_report_of_several_dirs_needs_out(tmp_path, capsys):
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sparsifiers", "micro,nope"], "unknown 'nope'"),
        (["--sparsifiers", "micro,micro"], "named twice"),
        (["--sparsifiers", "topk(wire=compact)"], "topk(wire=compact): wire must be one of"),
        (["--sparsifiers", "micro(lr=1)"], "give lr after -- for every run"),
        (["--task", "no-such-task"], "argument --task:"),
        (["--", "--epochs", "1", "--out=x"], "--out after --"),
        (["--", "--budget", "0.01"], "--budget after --"),
        (["--density", "0.01", "--budget", "0.01"], "give --density or --budget, not both"),
    ],
)
def test_compare_refuses_bad_arguments_before_training(tmp_path, capsys, args, message):
    assert main(["compare", *args, "--out", str(tmp_path / "cmp")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("microsparse compare: error: ")
    assert message in error[0]
    assert not (tmp_path / "cmp").exists()


def test_compare_runs_each_sparsifier_and_reports(tmp_path):
    out = tmp_path / "cmp"
    result = subprocess.run(
        [sys.executable, "-m", "microsparse_lab", "compare", "--sparsifiers", "dense,micro",
         "--workers", "2", "--density", "0.01", "--out", str(out), "--",
         "--max-steps", "4", "--batch-size", "16"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for name in ("dense", "micro"):
        records = (out / name / "metrics.jsonl").read_text().splitlines()
        assert len(records) == 4
        assert json.loads(records[0])["world_size"] == 2
    assert [row["run"] for row in read_csv(out / "results.csv")] == ["dense", "micro"]
    assert json.loads((out / "compare.json").read_text())["runs"] == ["dense", "micro"]
    for name in PLOT_FILES:
        assert (out / f"{name}.png").read_bytes().startswith(PNG_MAGIC)


def test_compare_at_equal_bytes_gives_every_run_the_budget(tmp_path):
    out = tmp_path / "cmp"
    assert main(["compare", "--sparsifiers", "topk,micro", "--workers", "2", "--budget", "0.004",
                 "--out", str(out), "--no-plots", "--", "--max-steps", "2", "--batch-size", "16",
                 "--epochs", "1"]) == 0  # fmt: skip
    for name in ("topk", "micro"):
        config = json.loads((out / name / "summary.json").read_text())["config"]
        assert config["budget"] == 0.004, name
    commands = json.loads((out / "compare.json").read_text())["commands"]
    assert all("--density" not in argv for argv in commands.values())
    # At equal bytes the compact wire (8-bit values, 9-bit offsets at this budget: 2.13 bytes
    # an entry) sends 3.76 times top-k's entries (8 bytes).
    targets = {name: json.loads((out / name / "metrics.jsonl").read_text().splitlines()[0])
               ["target"] for name in commands}  # fmt: skip
    assert 3.7 < targets["micro"] / targets["topk"] < 3.8, targets


def test_compare_runs_a_sparsifier_with_its_own_options_beside_its_default(tmp_path):
    """``name(key=value,...)``: the run's train gets those options, its directory and its row
    carry the label, so top-k's two wires stand side by side."""
    out = tmp_path / "cmp"
    assert main(["compare", "--sparsifiers", "topk,topk(wire=fixed)", "--workers", "2",
                 "--density", "0.01", "--out", str(out), "--no-plots", "--",
                 "--max-steps", "2", "--batch-size", "16", "--epochs", "1"]) == 0  # fmt: skip
    commands = json.loads((out / "compare.json").read_text())["commands"]
    assert list(commands) == ["topk", "topk(wire=fixed)"]
    assert commands["topk(wire=fixed)"][commands["topk(wire=fixed)"].index("--wire") + 1] == "fixed"
    assert "--wire" not in commands["topk"]
    exchanges = {name: json.loads((out / name / "metrics.jsonl").read_text().splitlines()[0])
                 ["exchange"] for name in commands}  # fmt: skip
    assert exchanges == {"topk": "union", "topk(wire=fixed)": "fixed_union"}
    assert [row["run"] for row in read_csv(out / "results.csv")] == list(commands)


def write_seed(directory: Path, sparsifier: str, metric: str, values: list[float], seed: int):
    write_run(directory, sparsifier, metric, values)
    summary = json.loads((directory / "summary.json").read_text())
    summary["config"]["seed"] = seed
    (directory / "summary.json").write_text(json.dumps(summary))


def test_seed_study_pairs_the_seeds_and_reports_gaps_in_points_or_per_cent(tmp_path, capsys):
    study = tmp_path / "study"
    write_seed(study / "dense" / "seed-1", "dense", "test_accuracy", [0.5, 0.9], 1)
    write_seed(study / "dense" / "seed-2", "dense", "test_accuracy", [0.6, 0.8], 2)
    write_seed(study / "micro" / "seed-2", "micro", "test_accuracy", [0.5, 0.8], 2)
    write_seed(study / "micro" / "seed-1", "micro", "test_accuracy", [0.4, 0.85], 1)
    assert main(["report", "--seeds", str(study), "--at", "1,2", "--window", "1,2"]) == 0
    table = (study / "quality.md").read_text()
    micro = next(line for line in table.splitlines() if line.startswith("| micro"))
    cells = [cell.strip() for cell in micro.strip("|").split("|")]
    assert cells[1] == "1,2"  # in seed order, whatever the directories' order
    selected = [10 + step % 3 for step in range(2 * STEPS_PER_EPOCH)]  # as write_run records
    assert cells[3] == f"{8 * sum(selected) / len(selected):,.0f}"  # 8 bytes an entry there
    assert cells[4] == "0.45 (-10.0 pt; -10.0…-10.0)"
    assert cells[5] == "0.825 (-2.5 pt; -5.0…+0.0)"  # paired by seed: −5 and 0 points
    assert cells[6] == "0.6375 (-6.2 pt; -7.5…-5.0)"
    assert (study / "quality.png").stat().st_size > 0
    # the plot's second axis: the bytes a rank had sent by each epoch's end, over seeds
    micro_variant = next(v for v in load_study(study) if v.name == "micro")
    by_epoch = [8 * sum(selected[:STEPS_PER_EPOCH * e]) for e in (1, 2)]
    assert [micro_variant.bytes_at(e) for e in (1, 2)] == by_epoch
    assert math.isnan(micro_variant.bytes_at(3))

    lm = tmp_path / "lm"
    write_seed(lm / "dense" / "seed-1", "dense", "valid_perplexity", [200.0], 1)
    write_seed(lm / "micro" / "seed-1", "micro", "valid_perplexity", [210.0], 1)
    assert main(["report", "--seeds", str(lm), "--at", "1", "--no-plots"]) == 0
    assert "210 (+5.0 %; +5.0…+5.0)" in (lm / "quality.md").read_text()
    assert main(["report", "--seeds", str(study), "--variants", "micro", "--out",
                 str(tmp_path / "only"), "--no-plots"]) == 0  # fmt: skip
    assert main(["report", "--seeds", str(study), "--variants", "nope"]) == 2
    assert "no runs of nope" in capsys.readouterr().err
    assert main(["report", "--seeds", str(tmp_path / "nothing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_seed_study_compares_another_recorded_metric_such_as_the_training_loss(tmp_path, capsys):
    lm = tmp_path / "lm"
    for name, losses in (("dense", [6.5, 6.2]), ("micro", [6.45, 6.26])):
        run = lm / name / "seed-1"
        write_seed(run, name, "valid_perplexity", [400.0, 380.0], 1)
        records = [json.loads(line) for line in (run / "epochs.jsonl").read_text().splitlines()]
        for record, loss in zip(records, losses):
            record["train_loss"] = loss
        (run / "epochs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", "--seeds", str(lm), "--at", "1,2", "--metric", "train_loss",
                 "--no-plots"]) == 0  # fmt: skip
    micro = next(line for line in (lm / "quality.md").read_text().splitlines()
                 if line.startswith("| micro"))  # fmt: skip
    cells = [cell.strip() for cell in micro.strip("|").split("|")]
    assert cells[4:] == ["6.45 (-0.050 nat; -0.050…-0.050)", "6.26 (+0.060 nat; +0.060…+0.060)"]
    assert main(["report", "--seeds", str(lm), "--metric", "hr@10", "--no-plots"]) == 2
    assert "records no 'hr@10'" in capsys.readouterr().err
    assert main(["report", "--seeds", str(lm), "--metric", "loss"]) == 2
    assert "metric must be one of" in capsys.readouterr().err
    assert main(["report", str(lm / "micro" / "seed-1"), "--metric", "train_loss"]) == 2
    assert "only with --seeds" in capsys.readouterr().err
