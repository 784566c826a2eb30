"""``microsparse train``: a real two-worker run, and clean refusals of bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from microsparse.comm.collectives import all_reduce_bytes
from microsparse_lab.cli import build_parser, main
from microsparse_lab.cli.train import _config as config_of
from tiny_datasets import write_cifar, write_ratings, write_wikitext

STEP_FIELDS = {
    "step", "epoch", "loss", "compute_seconds", "selected", "target", "density",
    "target_density", "threshold", "local_selected", "partition", "bytes_sent", "dense_bytes",
    "select_seconds", "exchange_seconds", "ratio_error", "padding_overhead", "traffic_ratio",
}  # fmt: skip
SUMMARY_FIELDS = {
    "config", "steps", "test_accuracy", "final_loss", "ratio_error_mean",
    "ratio_error_mean_after_warmup", "after_warmup_steps", "traffic_ratio", "seconds",
    "seconds_per_step", "task", "model", "metric", "metrics", "metric_names",
}  # fmt: skip


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "microsparse_lab", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


TINY_RUN = ("train", "--workers", "2", "--no-progress")
"""A real two-worker run of the default task; add --max-steps and --out or --resume."""


@pytest.mark.parametrize("integration", ["loop", "ddp", "ddp --one-exchange"])
def test_two_worker_run_writes_a_record_per_step_and_a_summary(integration, tmp_path):
    out = tmp_path / "run"
    integration, *one_exchange = integration.split()
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
        *one_exchange,
        "--checkpoint-every",
        "2",
    )
    assert result.returncode == 0, result.stderr
    # The workers end without the interpreter's teardown; nothing of theirs is left behind.
    assert "leaked semaphore" not in result.stderr, result.stderr

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
    assert summary["config"]["one_exchange"] == bool(one_exchange)
    # what the default wire sent, by name: a later default cannot change a resumed run
    assert summary["config"]["value_dtype"] == "int8"
    assert 0 <= summary["test_accuracy"] <= 1
    assert 0 < summary["traffic_ratio"] < 1
    assert summary["final_loss"] == records[-1]["loss"]
    assert summary["after_warmup_steps"] == [2, 4]
    assert summary["seconds"]["wall"] > sum(r["compute_seconds"] for r in records) > 0
    assert summary["task"] == "mnist" and summary["model"] == "smallcnn"
    assert summary["metric"] == "test_accuracy" and summary["higher_is_better"]
    epochs = [json.loads(line) for line in (out / "epochs.jsonl").read_text().splitlines()]
    assert len(epochs) == 1 and epochs[0]["metric"] == "test_accuracy"
    assert epochs[0]["value"] == epochs[0]["test_accuracy"] == summary["test_accuracy"]
    assert "test accuracy" in result.stdout
    if integration == "ddp":
        return
    # The same command resumes from the checkpoint and continues the files.
    result = run_cli("train", "--resume", str(out), "--max-steps", "8", "--no-progress")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(8))
    assert json.loads((out / "summary.json").read_text())["steps"] == 8
    meta = json.loads((out / "checkpoint" / "meta.json").read_text())
    assert (meta["step"], meta["epoch"], meta["batch"], meta["world_size"]) == (8, 0, 8, 2)


def records_by_value_dtype(tmp_path, dtypes, *flags: str) -> dict[str, list[dict]]:
    """Each step's record of a 3-step, 2-worker run at density 0.01 per value dtype
    (``float32``: the option left out)."""
    records = {}
    for dtype in dtypes:
        out = tmp_path / dtype
        extra = [] if dtype == "float32" else ["--value-dtype", dtype]
        result = run_cli("train", "--workers", "2", "--max-steps", "3", "--density", "0.01",
                         "--no-progress", "--out", str(out), *flags, *extra)  # fmt: skip
        assert result.returncode == 0, result.stderr
        lines = (out / "metrics.jsonl").read_text().splitlines()
        records[dtype] = [json.loads(line) for line in lines]
    return records


def test_value_dtype_sends_the_values_in_16_bits(tmp_path):
    records = records_by_value_dtype(tmp_path, ("float32", "bfloat16"), "--wire", "plain")
    for wide, narrow in zip(records["float32"], records["bfloat16"]):
        assert wide["selected"] == narrow["selected"] > 0  # quotas: k every step
        # The same index message; the value all-reduce carries 2 bytes an entry, not 4.
        k = wide["selected"]
        saved = all_reduce_bytes(4 * k, 2) - all_reduce_bytes(2 * k, 2)
        assert wide["bytes_sent"] - narrow["bytes_sent"] == saved
    summary = json.loads((tmp_path / "bfloat16" / "summary.json").read_text())
    assert summary["config"]["value_dtype"] == "bfloat16"


def test_compact_wire_sends_the_same_entries_in_about_a_quarter_of_the_bytes(tmp_path):
    records = {}
    for wire in ("plain", "compact"):
        out = tmp_path / wire
        result = run_cli("train", "--workers", "2", "--max-steps", "3", "--density", "0.01",
                         "--wire", wire, "--no-progress", "--out", str(out))  # fmt: skip
        assert result.returncode == 0, result.stderr
        lines = (out / "metrics.jsonl").read_text().splitlines()
        records[wire] = [json.loads(line) for line in lines]
    for plain, compact in zip(records["plain"], records["compact"]):
        assert plain["selected"] == compact["selected"] > 0
        # on 2 ranks' ring, 2 + 4 bytes an entry against about 0.54 + 1 (8.6-bit offsets at
        # density 0.01, 8-bit values), and a scale word a rank
        assert 0.23 < compact["bytes_sent"] / plain["bytes_sent"] < 0.28
    summary = json.loads((tmp_path / "compact" / "summary.json").read_text())
    assert summary["config"]["wire"] == "compact"


def test_top_ks_fixed_wire_trains_as_its_union_does(tmp_path):
    """The same averages, so the same run: the same union every step, no count header, and
    values at all n·k slots."""
    records = {}
    for wire in ("union", "fixed"):
        out = tmp_path / wire
        result = run_cli("train", "--workers", "2", "--max-steps", "3", "--density", "0.01",
                         "--sparsifier", "topk", "--wire", wire, "--no-progress",
                         "--out", str(out))  # fmt: skip
        assert result.returncode == 0, result.stderr
        lines = (out / "metrics.jsonl").read_text().splitlines()
        records[wire] = [json.loads(line) for line in lines]
    for union, fixed in zip(records["union"], records["fixed"], strict=True):
        assert union["loss"] == fixed["loss"]
        k = union["target"]
        assert k < union["selected"] == fixed["selected"] <= 2 * k  # the union, build-up
        # No [step, count] header (16 bytes a rank); 2·k values instead of the union's K.
        values = all_reduce_bytes(4 * 2 * k, 2) - all_reduce_bytes(4 * union["selected"], 2)
        assert fixed["bytes_sent"] - union["bytes_sent"] == values - 16


@pytest.mark.parametrize("hook", ["ddp", "fp16", "powersgd(rank=2)", "powersgd(rank=2,start=3)"])
def test_training_with_torchs_hooks_for_comparison(hook, tmp_path):
    """``--ddp-hook``: the same training through stock DDP and torch's hooks, with their
    bytes per step from the peers' model and the runs labelled by the hook."""
    from microsparse_lab.methods.traffic import peer_bytes
    from microsparse_lab.reports import load_run
    from microsparse_lab.training import TrainConfig
    from microsparse_lab.training.tasks import get_task

    out = tmp_path / "run"
    result = run_cli("train", "--workers", "2", "--max-steps", "4", "--no-progress",
                     "--integration", "ddp", "--ddp-hook", hook, "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["loss"] == r["loss"] for r in records)  # trained, no NaN
    config = TrainConfig(task="mnist").resolved()  # the MNIST CNN, as the run built it
    task = get_task("mnist")
    data = task.load(None, config.task_options)
    model = task.build_model(config.model, data, 1, config.model_options)
    shapes = [tuple(p.shape) for p in model.parameters()]
    expected = peer_bytes(hook, shapes, 2)
    dense = records[0]["dense_bytes"]
    plain = 0  # PowerSGD's plain all-reduce steps: 2 by default, or the name's start
    if hook.startswith("powersgd"):
        plain = 3 if "start=3" in hook else 2
    assert [r["bytes_sent"] for r in records] == [dense] * plain + [expected] * (4 - plain)
    assert all(r["padding_overhead"] == 0 for r in records)  # no index message
    assert expected == {"ddp": dense, "fp16": dense // 2}.get(hook, expected) and expected > 0
    if hook.startswith("powersgd"):
        assert expected < dense / 10
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["ddp_hook"] == hook
    assert f"DDP hook {hook}" in result.stdout
    assert load_run(out).sparsifier == hook


def test_the_hooks_min_speedup_choice_is_in_the_summary(tmp_path):
    out = tmp_path / "run"
    # 1000x faster is never met: the probe's 6 dense steps, then dense from step 20 on.
    result = run_cli("train", "--workers", "2", "--max-steps", "23", "--no-progress", "--out",
                     str(out), "--integration", "ddp", "--min-speedup", "1000")  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["min_speedup"]["choice"] == "dense"
    assert len(summary["min_speedup"]["medians"]) == 2  # a row per rank: sparse, dense
    assert summary["dense_steps"] == 6 + 3 and summary["sparse_steps"] == 23 - 9
    # Quotas select k entries a sparse step; the dense steps, K = d, are no selection error.
    assert summary["ratio_error_mean"] < 0.01 and summary["ratio_error_mean_after_warmup"] < 0.01
    assert summary["selected_over_target_mean"] == pytest.approx(1, abs=0.01)
    assert "|K/k - 1| of the sparse steps (9 dense ones left out): 0.0" in result.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    dense = [r["step"] for r in records if r.get("averaging") == "dense"]
    assert dense == [9, 11, 13, 15, 17, 19, 20, 21, 22]
    assert all(r["selected"] == r["numel"] for r in records if r["step"] in dense)
    assert "min_speedup 1000: chose dense (median step" in result.stdout


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
        (["--selection", "quota", "--threshold-rule", "as_coded"], "--selection"),
        (["--sparsifier", "topk", "--partitioning", "contiguous"], "--partitioning"),
        (["--sparsifier", "sage", "--index-message", "padded"], "--index-message"),
        (["--sparsifier", "topk", "--wire", "compact"], "--wire"),
        (["--wire", "zip"], "--wire"),
        (["--wire", "fixed"], "--wire"),  # top-k's wire, not MiCRO's
        (["--task", "cifar10"], "--data-dir"),
        (["--data-dir", "."], "--data-dir"),
        (["--model-option", "depth=3"], "--model-option"),
        (["--task-option", "bptt"], "--task-option"),
        (["--integration", "ddp", "--capture-gradients", "x"], "--capture-gradients"),
        (["--checkpoint-every", "0"], "--checkpoint-every"),
        (["--adam-correction"], "--adam-correction"),  # the MNIST recipe is SGD
        (["--value-dtype", "float64"], "--value-dtype"),
        (["--wire", "plain", "--value-dtype", "int8"], "--value-dtype"),
        (["--sparsifier", "topk", "--value-dtype", "int8"], "--value-dtype"),
        (["--sparsifier", "dense", "--value-dtype", "float16"], "--value-dtype"),
        (["--task", "lm", "--optimizer", "adam", "--adam-correction"], "--adam-correction"),
        (["--decay-epochs", "a"], "--decay-epochs"),
        (["--ddp-hook", "fp16"], "--ddp-hook"),  # a DDP hook needs --integration ddp
        (["--integration", "ddp", "--ddp-hook", "topk"], "--ddp-hook"),
        (["--integration", "ddp", "--ddp-hook", "powersgd(rnk=2)"], "--ddp-hook"),
        (["--integration", "ddp", "--ddp-hook", "powersgd(buckets=default)"], "--ddp-hook"),
        (["--integration", "ddp", "--ddp-hook", "powersgd(start=1)"], "--ddp-hook"),
        (["--one-exchange"], "--one-exchange"),  # an option of the DDP hook
        (["--integration", "ddp", "--ddp-hook", "fp16", "--one-exchange"], "--one-exchange"),
        (["--min-speedup", "1.1"], "--min-speedup"),  # an option of the DDP hook
        (["--integration", "ddp", "--min-speedup", "0"], "--min-speedup"),
        (["--integration", "ddp", "--sparsifier", "dense", "--min-speedup", "1.1"],
         "--min-speedup"),
        (["--integration", "ddp", "--momentum-correction", "--min-speedup", "1.1"],
         "--min-speedup"),
        (["--task", "recommendation", "--integration", "ddp", "--min-speedup", "1.1"],
         "--min-speedup"),  # Adam correction is on for its recipe
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


@pytest.mark.parametrize(
    ("args", "option", "choices"),
    [
        (["--task", "imagenet"], "--task", "cifar10', 'cifar100', 'lm', 'mnist', 'recommendation"),
        (["--model", "vgg"], "--model", "smallcnn, resnet18, senet18, googlenet"),
        (["--task", "lm", "--model", "gpt"], "--model", "lstm-small, lstm"),
    ],
)
def test_unknown_task_or_model_lists_the_choices(args, option, choices, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *args, "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {option}:" in error and choices in error


@pytest.mark.parametrize(
    ("task", "write", "missing", "format_hint"),
    [
        ("cifar10", lambda d: write_cifar(d, 10, per_file=2), "data_batch_2", "CIFAR-10 python"),
        ("cifar100", lambda d: write_cifar(d, 100, per_file=2), "train", "CIFAR-100 python"),
        ("lm", write_wikitext, "wiki.test.tokens", "WikiText-2"),
        ("recommendation", write_ratings, "ratings.csv", "userId,movieId,rating,timestamp"),
    ],
)
def test_data_dir_missing_a_file_names_it_and_the_format(
    task, write, missing, format_hint, capsys, tmp_path
):
    data = tmp_path / "data"
    write(data)
    (data / missing).unlink()
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--task", task, "--data-dir", str(data), "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"argument --data-dir: --data-dir {data}: missing {missing}; expected" in error
    assert format_hint in error


def parsed_config(*args: str):
    parser = build_parser()
    parsed = parser.parse_args(["train", *args])
    return config_of(parsed, parsed.parser)[0].resolved()


def test_config_file_is_between_the_recipe_and_the_command_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"task": "lm", "lr": 3.0, "clip": 0.1, "epochs": 2}))
    config = parsed_config("--config", str(path), "--lr", "7", "--out", str(tmp_path))
    assert (config.task, config.lr, config.clip, config.epochs) == ("lm", 7.0, 0.1, 2)
    assert config.task_options["bptt"] == 30  # the task's default
    options = parsed_config("--task", "lm", "--model-option", "units=16", "--task-option", "bptt=7")
    assert options.model_options["units"] == 16 and options.task_options["bptt"] == 7
    epochwise = parsed_config("--checkpoint-every", "epoch", "--decay-epochs", "3,5")
    assert epochwise.checkpoint_per_epoch and epochwise.decay_epochs == (3, 5)
    assert parsed_config("--task", "recommendation").adam_correction  # on where it applies
    assert not parsed_config("--task", "recommendation", "--no-adam-correction").adam_correction


def test_a_bad_value_from_the_config_file_names_the_file(capsys, tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"density": 2.0, "threshold_rule": "symmetric"}))
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(config), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert f"argument --config: {config}: density must be in (0, 1]" in capsys.readouterr().err
    # an error found while the config resolves, too; the command line's own values by flag
    config.write_text(json.dumps({"sparsifier": "topk", "value_dtype": "int8"}))
    with pytest.raises(SystemExit):
        main(["train", "--config", str(config), "--out", str(tmp_path / "out")])
    assert f"argument --config: {config}: value_dtype=torch.int8 needs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--config", str(config), "--value-dtype", "int8", "--out", str(tmp_path)])
    assert "argument --value-dtype: value_dtype=torch.int8 needs" in capsys.readouterr().err


def test_config_file_with_an_unknown_key_exits_2(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"learning_rate": 3}')
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(path), "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert "argument --config:" in capsys.readouterr().err


def test_resume_refuses_other_worker_counts_and_changed_options(capsys, tmp_path):
    saved = {"task": "mnist", "lr": 0.05}
    meta = {"epoch": 0, "batch": 3, "step": 3, "world_size": 2, "config": saved}
    run, damaged = tmp_path / "run", tmp_path / "damaged"
    for out, parts in ((run, ("shared", "rank0", "rank1")), (damaged, ("shared", "rank0"))):
        (out / "checkpoint").mkdir(parents=True)
        (out / "checkpoint" / "meta.json").write_text(json.dumps({**meta, "out": str(out)}))
        for part in parts:
            torch.save({}, out / "checkpoint" / f"{part}.pt")
    (tmp_path / "torn" / "checkpoint").mkdir(parents=True)
    (tmp_path / "torn" / "checkpoint" / "meta.json").write_text('{"epoch": 0, "ba')
    for args, message in [
        ([str(damaged)], f"argument --resume: {damaged / 'checkpoint' / 'rank1.pt'} is missing"),
        ([str(tmp_path / "torn")], "meta.json cannot be read"),
        ([str(run), "--workers", "3"], "argument --workers: the checkpoint was written by 2"),
        ([str(run), "--lr", "0.1"], "argument --lr: cannot change when resuming"),
        # an older checkpoint's default values: this version would send int8, maybe others
        ([str(run)], f"argument --resume: {run} holds a checkpoint of a run that did not "
                     "record the dtype its values travelled in"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--resume", *args])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_a_users_file_in_the_checkpoint_folder_is_refused_and_kept(tmp_path):
    """A folder named checkpoint that the user filled is not taken for an empty checkpoint
    (which the first save would replace, deleting the file)."""
    mine = tmp_path / "run" / "checkpoint" / "my_model.pt"
    mine.parent.mkdir(parents=True)
    mine.write_text("x")
    for where in (["--resume", str(tmp_path / "run")], ["--out", str(tmp_path / "run")]):
        result = run_cli(*TINY_RUN, "--max-steps", "2", "--checkpoint-every", "1", *where)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert f"argument {where[0]}: {mine} was not written by microsparse" in result.stderr
        assert f"move my_model.pt elsewhere, or choose another {where[0]}" in result.stderr
        assert "starting a fresh run" not in result.stderr
        assert mine.read_text() == "x"
        assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == ["checkpoint", mine.name]


def test_a_users_run_file_in_the_out_folder_is_refused_and_kept(capsys, tmp_path):
    mine = tmp_path / "out" / "metrics.jsonl"
    mine.parent.mkdir()
    mine.write_text("my own metrics\n")
    for flags in ([], ["--overwrite"]):  # not even --overwrite: the file is not microsparse's
        with pytest.raises(SystemExit) as exit_info:
            main([*TINY_RUN, "--max-steps", "2", "--out", str(mine.parent), *flags])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert f"argument --out: {mine} was not written by microsparse" in error
        assert "choose another --out directory" in error
        assert mine.read_text() == "my own metrics\n"
        assert [p.name for p in mine.parent.iterdir()] == ["metrics.jsonl"]  # nothing written


def test_a_finished_run_is_replaced_only_with_overwrite(tmp_path):
    out = tmp_path / "run"
    result = run_cli(*TINY_RUN, "--max-steps", "2", "--checkpoint-every", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    notes = out / "notes.txt"  # the user's own file, next to the run's
    notes.write_text("keep me")
    summary = (out / "summary.json").read_bytes()
    refused = run_cli(*TINY_RUN, "--max-steps", "3", "--out", str(out))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert (
        f"argument --out: {out} holds a finished run ({out / 'summary.json'}): add --overwrite "
        "to replace it, or choose another --out directory"
    ) in refused.stderr
    assert (out / "summary.json").read_bytes() == summary
    replaced = run_cli(*TINY_RUN, "--max-steps", "3", "--out", str(out), "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert f"replacing the earlier run in {out}" in replaced.stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    # The old run's checkpoint is gone with it: --resume cannot mix it with the new files.
    assert not (out / "checkpoint").exists()
    assert notes.read_text() == "keep me"


def test_an_interrupted_run_continues_with_resume_only(tmp_path):
    """A real run killed after its first checkpoints: a fresh --out there is refused (it
    names --resume), and --resume continues it to the end."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "microsparse_lab", *TINY_RUN, "--max-steps", "1000"]
    command += ["--checkpoint-every", "2", "--resume", str(out)]
    run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint" / "meta.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # the launcher and its workers, at once
        run.wait()
    step = json.loads((out / "checkpoint" / "meta.json").read_text())["step"]
    assert step >= 2 and not (out / "summary.json").exists()
    refused = run_cli(*TINY_RUN, "--max-steps", "3", "--out", str(out))
    assert refused.returncode == 2
    assert f"unfinished run with a checkpoint ({out / 'checkpoint'}): continue it with " \
        f"--resume {out}, or add --overwrite" in refused.stderr  # fmt: skip
    result = run_cli(*TINY_RUN, "--max-steps", str(step + 2), "--resume", str(out))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(step + 2))
    assert json.loads((out / "summary.json").read_text())["steps"] == step + 2


def test_earlier_captured_gradients_are_replaced_only_with_overwrite(capsys, tmp_path):
    grads = tmp_path / "grads"
    grads.mkdir()
    (grads / "layout.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main([*TINY_RUN, "--out", str(tmp_path / "run"), "--capture-gradients", str(grads)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"argument --capture-gradients: {grads} already holds captured gradients" in error
    assert "add --overwrite" in error and not (tmp_path / "run").exists()


def test_a_reader_that_stops_early_ends_the_output_quietly(tmp_path):
    """``microsparse ... | head``: train goes on to write its run, report stops; neither
    prints a traceback."""
    out = tmp_path / "run"

    def closed_stdout(*args: str) -> tuple[int, str]:
        command = [sys.executable, "-m", "microsparse_lab", *args]
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        process = subprocess.Popen(command, **pipes)
        process.stdout.close()  # long before the command prints: the reader has gone
        _, stderr = process.communicate(timeout=120)
        return process.returncode, stderr

    code, stderr = closed_stdout(*TINY_RUN, "--max-steps", "2", "--out", str(out))
    assert code == 0 and "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    code, stderr = closed_stdout("report", str(out), "--no-plots")
    assert (code, stderr) == (141, "")  # 128 + SIGPIPE, as a shell reports `| head`'s writer


def test_hookstep_prints_its_help():
    result = subprocess.run([sys.executable, "-m", "microsparse_lab.bench.hookstep", "--help"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    usage = " ".join(result.stdout.split("\n\n")[0].split())
    assert usage == ("usage: python -m microsparse_lab.bench.hookstep [-h] [--bucket-cap-mb MB] "
                     "[--width WIDTH] [--layers LAYERS] [--rows ROWS] [ranks] [steps]")
