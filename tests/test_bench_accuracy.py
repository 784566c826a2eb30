"""``microsparse bench accuracy``: real trainings on the namespace test bed, to a target."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from microsparse_lab.bench.accuracy import AccuracyConfig, train_arguments
from microsparse_lab.cli import main
from microsparse_lab.reports import PLOTS
from test_bench_cluster import leftovers, namespaces  # noqa: F401  (the fixture, by name)

needs_namespaces = pytest.mark.usefixtures("namespaces")


def test_each_method_becomes_the_train_options_that_mean_it():
    config = AccuracyConfig(task="lm", density=0.01, seed=3)
    assert train_arguments("micro", config) == [
        "--task", "lm", "--density", "0.01", "--sparsifier", "micro", "--integration", "loop",
        "--seed", "3", "--device", "cpu", "--no-progress",
    ]  # fmt: skip
    assert train_arguments("topk@ddp", config)[4:8] == [
        "--sparsifier", "topk", "--integration", "ddp",
    ]  # fmt: skip
    assert train_arguments("micro@ddp(exchange=one)", config)[4:9] == [
        "--sparsifier", "micro", "--integration", "ddp", "--one-exchange",
    ]  # fmt: skip
    assert train_arguments("micro@fsdp(exchange=one)", config)[4:9] == [
        "--sparsifier", "micro", "--integration", "fsdp", "--one-exchange",
    ]  # fmt: skip
    assert train_arguments("micro@ddp(min_speedup=1.1)", config)[4:10] == [
        "--sparsifier", "micro", "--integration", "ddp", "--min-speedup", "1.1",
    ]  # fmt: skip
    reference = train_arguments("micro-reference", config)
    assert "--threshold-rule" in reference and "as_coded" in reference
    peer = train_arguments("powersgd(rank=4)", config)
    assert peer[4:8] == ["--integration", "ddp", "--ddp-hook", "powersgd(rank=4)"]
    assert train_arguments("micro@fsdp", config)[4:8] == [
        "--sparsifier", "micro", "--integration", "fsdp",
    ]  # fmt: skip
    assert train_arguments("dense@fsdp", config)[4:8] == [
        "--sparsifier", "dense", "--integration", "fsdp",
    ]  # fmt: skip
    own = train_arguments("micro(selection=threshold,density=0.03)@ddp", config)
    assert own[2:10] == [
        "--density", "0.03", "--sparsifier", "micro", "--integration", "ddp",
        "--selection", "threshold",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"methods": ("micro", "fp16")}, "must include dense"),
        ({"methods": ("dense", "none")}, "'none' trains no model"),
        ({"methods": ("dense", "none@ddp")}, "'none@ddp' trains no model"),
        ({"methods": ("dense", "micro@ddp(buckets=one)")}, "a bench cluster option"),
        ({"methods": ("dense", "nope")}, "unknown"),
        ({"methods": ("dense", "micro(density=0)@ddp")}, r"density must be a number in \(0, 1\]"),
        ({"methods": ("dense", "fp16(density=0.1)")}, r"fp16 takes no option \['density'\]"),
        ({"methods": ("dense", "fp16@fsdp")}, "@fsdp follows a sparsifier"),
        ({"methods": ("dense", "micro@ddp@fsdp")}, "@fsdp follows a sparsifier"),
        ({"methods": ("dense", "dense@fsdp(exchange=one)")}, "@fsdp follows a sparsifier"),
        ({"ranks_per_host": 0}, "ranks_per_host: must be at least 1"),
        ({"hosts": 1}, "hosts must be at least 2"),
        ({"target_fraction": 1.5}, "target_fraction"),
    ],
)
def test_bad_configurations_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        AccuracyConfig(**options)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--", "--density", "0.1"], "--density after --: set by bench accuracy itself"),
        (["--", "--spars=topk"], "--sparsifier after --"),  # argparse would take a prefix
        (["--", "--config", "x.json"], "--config after --"),
        (["--task", "chess"], "argument --task: must be one of"),
        (["--target-fraction", "1.5"], "argument --target-fraction: must be in (0, 1]"),
        (["--methods", "micro,fp16"], "argument --methods: must include dense"),
        (["--methods", "dense,none"], "argument --methods: 'none' trains no model"),
        (["--methods", "dense,nope"], "argument --methods: method 'nope': unknown"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_built(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "accuracy", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@needs_namespaces
def test_a_tiny_run_trains_every_method_and_reports_the_target(tmp_path):
    out = tmp_path / "accuracy"
    code = main([
        "bench", "accuracy", "--hosts", "2", "--rates", "1gbit",
        "--methods", "dense,micro,micro@ddp,fp16,powersgd", "--out", str(out),
        "--", "--max-steps", "6", "--epochs", "2", "--batch-size", "16",
    ])  # fmt: skip
    assert code == 0
    assert leftovers(os.getpid()) == []
    results = json.loads((out / "results.json").read_text())
    [rate] = results["rates"]
    assert rate["rate"] == "1gbit" and rate["target"] > 0
    assert "98% of the dense run's final test_accuracy" == rate["target_source"]
    rows = {row["run"]: row for row in rate["rows"]}
    assert list(rows) == ["dense", "micro", "micro@ddp", "fp16", "powersgd"]
    for row in rows.values():
        assert row["steps"] == 6 and row["workers"] == 2 and row["wall_seconds"] > 0
    dense = rows["dense"]
    assert dense["epochs_to_target"] is not None  # dense reaches 98 % of its own final
    assert rows["fp16"]["bytes_per_step"] == pytest.approx(dense["bytes_per_step"] / 2, rel=1e-3)
    assert rows["micro"]["bytes_per_step"] < dense["bytes_per_step"] / 50
    for name in ("dense", "micro", "micro-at-ddp", "fp16", "powersgd"):
        summary = json.loads((out / "1gbit" / name / "summary.json").read_text())
        assert summary["config"]["world_size"] == 2
    report = (out / "1gbit" / "results.md").read_text()
    assert "| micro@ddp |" in report and "MB/worker to target" in report
    if importlib.util.find_spec("matplotlib") is not None:
        assert "metric_vs_time" in PLOTS
        assert (out / "1gbit" / "metric_vs_time.png").stat().st_size > 0


@needs_namespaces
def test_sharded_training_shards_inside_a_host_and_averages_sparsely_between(tmp_path):
    out = tmp_path / "sharded"
    code = main([
        "bench", "accuracy", "--hosts", "2", "--ranks-per-host", "2", "--rates", "1gbit",
        "--methods", "dense@fsdp,micro@fsdp", "--density", "0.01", "--out", str(out),
        "--", "--max-steps", "4", "--epochs", "1", "--batch-size", "16",
    ])  # fmt: skip
    assert code == 0
    assert leftovers(os.getpid()) == []
    [rate] = json.loads((out / "results.json").read_text())["rates"]
    rows = {row["run"]: row for row in rate["rows"]}
    assert rows["dense@fsdp"]["workers"] == rows["micro@fsdp"]["workers"] == 4
    # Between hosts each rank sends its shard's share: all of it, or about the density's.
    assert rows["micro@fsdp"]["bytes_per_step"] < rows["dense@fsdp"]["bytes_per_step"] / 20
    # ... and the links agree: read from the hosts' counters just after the first step (the
    # set-up, rank 0's weights sent to every rank, left out) and just after the last (the
    # evaluation left out); two ranks a host, each sending its shard once in a 2-rank ring.
    links = {row["run"]: row for row in rate["links"]}
    dense, micro = links["dense@fsdp"], links["micro@fsdp"]
    assert 1 <= dense["steps"] <= 3 and 1 <= micro["steps"] <= 3
    shard = rows["dense@fsdp"]["bytes_per_step"]
    assert 1.8 * shard < dense["link_bytes_per_host_step"] < 2.4 * shard
    assert dense["link_packets_per_host_step"] > 0 and micro["link_packets_per_host_step"] > 0
    assert micro["link_bytes_per_host_step"] < dense["link_bytes_per_host_step"] / 10
    for name in ("dense-at-fsdp", "micro-at-fsdp"):
        config = json.loads((out / "1gbit" / name / "summary.json").read_text())["config"]
        assert config["integration"] == "fsdp" and config["world_size"] == 4
