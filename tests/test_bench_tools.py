"""The benchmark tools run once each on tiny sizes and write well-formed output.

Nothing here asserts on a timing: benchmarks are not timed tests.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from microsparse.comm.collectives import all_reduce_bytes
from microsparse.comm.local import SymmetricPeers
from microsparse.reducer import GradientReducer
from microsparse.sparsifiers.threshold import THRESHOLD_RULES, initial_threshold
from microsparse_lab.bench import costmodel, peermodel, simulate
from microsparse_lab.bench.capture import CaptureError, load_capture
from microsparse_lab.bench.overhead import OverheadConfig
from microsparse_lab.bench.workload import RESNET18_NUMEL, model_layout
from microsparse_lab.cli import bench, main
from microsparse_lab.methods.names import variants

pytest.importorskip("matplotlib")


def run_bench(*argv: str) -> int:
    """``microsparse bench ...`` through the sub-command parsers of ``cli/bench.py``."""
    parser = argparse.ArgumentParser(prog="microsparse")
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    return args.run(args, args.parser)


def table_rows(markdown: str, first_cell: str) -> list[list[str]]:
    rows = [line.strip("|").split("|") for line in markdown.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows if row[0].strip() == first_cell]


def write_capture(directory, ranks=2, steps=3, sizes=(300, 20, 180), scale=1e-3) -> torch.Tensor:
    """A capture directory in ``microsparse train --capture-gradients``'s format."""
    directory.mkdir(parents=True, exist_ok=True)
    shapes = [[size] for size in sizes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    layout = {"names": [f"layer{i}" for i in range(len(sizes))], "shapes": shapes,
              "offsets": offsets, "numel": sum(sizes), "task": "test", "model": "tiny",
              "world_size": ranks, "steps": steps}  # fmt: skip
    (directory / "layout.json").write_text(json.dumps(layout))
    generator = torch.Generator().manual_seed(0)
    first = None
    for rank in range(ranks):
        for step in range(steps):
            gradient = torch.randn(sum(sizes), generator=generator) * scale
            torch.save(gradient, directory / f"grad-rank{rank}-step{step:06d}.pt")
            first = gradient if first is None else first
    return first


def test_select_writes_a_row_per_sparsifier_and_n(tmp_path):
    out = tmp_path / "select"
    code = run_bench(
        "select", "--sizes", "20000", "--partitions", "1,4", "--repeats", "1", "--budget", "0.1",
        "--devices", "cpu", "--threads", "1", "--quiet", "--out", str(out),
    )  # fmt: skip
    assert code == 0
    result = json.loads((out / "select.json").read_text())
    labels = [v.label for v in variants()]
    assert {(r["sparsifier"], r["world_size"]) for r in result["rows"]} == {
        (label, n) for label in labels for n in (1, 4)
    }
    for row in result["rows"]:
        assert row["select_ms"] >= 0 and row["overhead_ms"] > 0 and row["numel"] == 20_000
        assert math.isclose(row["overhead_per_pass"] * result["floors"][0]["pass_ms"],
                            row["overhead_ms"])  # fmt: skip
    assert result["floors"][0]["topk_ms"] > 0 and result["machine"]["cpus"] >= 1
    markdown = (out / "select.md").read_text()
    for label in labels:
        assert len(table_rows(markdown, label)) == 2  # selection and overhead tables
    assert (out / "select_vs_n.png").stat().st_size > 0
    assert (out / "overhead_vs_n.png").stat().st_size > 0
    again = tmp_path / "again"
    assert (
        run_bench("select", "--from", str(out / "select.json"), "--quiet", "--out", str(again)) == 0
    )
    assert (again / "select.md").read_text() == markdown


def test_controller_covers_every_rule_and_stream_including_captured(tmp_path):
    capture = tmp_path / "capture"
    first = write_capture(capture, scale=0.1)
    out = tmp_path / "controller"
    code = run_bench(
        "controller", "--numel", "20000", "--density", "0.05", "--steps", "30", "--drop-at", "10",
        "--rise-at", "20", "--capture", str(capture), "--capture-density", "0.05", "--quiet",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0
    result = json.loads((out / "controller.json").read_text())
    streams = ("stationary", "scale-drop", "captured")
    assert {(r["stream"], r["rule"]) for r in result["rows"]} == {
        (stream, rule) for stream in streams for rule in THRESHOLD_RULES
    }
    for row in result["rows"]:
        assert len(row["ratios"]) == (3 if row["stream"] == "captured" else 30)
        assert all(r >= 0 for r in row["ratios"])
        assert row["steps_to_converge"] is None or 0 <= row["steps_to_converge"] < 30
    # Every rule sees the captured gradients as they were saved (not what a run wrote back).
    k = int(0.05 * 500)
    sent_first = int((first.abs() >= initial_threshold(k)).sum())
    for row in result["rows"]:
        if row["stream"] == "captured" and row["rule"] != "quantile":
            assert row["ratios"][0] == sent_first / k
    dropped = [r for r in result["rows"] if r["stream"] == "scale-drop"]
    assert all("steps_to_recover_after_drop" in r for r in dropped)
    markdown = (out / "controller.md").read_text()
    for stream in streams:
        assert len(table_rows(markdown, stream)) == len(THRESHOLD_RULES)
    assert (out / "density_vs_step.png").stat().st_size > 0
    again = tmp_path / "again"
    code = run_bench("controller", "--from", str(out / "controller.json"), "--quiet", "--out",
                     str(again))  # fmt: skip
    assert code == 0 and (again / "controller.md").read_text() == markdown


def test_controller_with_virtual_workers(tmp_path):
    out = tmp_path / "controller"
    code = run_bench(
        "controller", "--numel", "5000", "--density", "0.05", "--steps", "6", "--drop-at", "2",
        "--rise-at", "4", "--workers", "4", "--rules", "symmetric", "--no-plots", "--quiet",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0
    result = json.loads((out / "controller.json").read_text())
    assert [r["rule"] for r in result["rows"]] == ["symmetric", "symmetric"]


def test_simulate_predicts_and_validates_against_a_cluster_file(tmp_path):
    capture = tmp_path / "capture"
    write_capture(capture, ranks=2, steps=2, sizes=(3000, 40, 960))
    cluster = tmp_path / "results.json"
    cluster.write_text(json.dumps({"configurations": [{
        "hosts": 2, "rate": "1gbit",
        "probe": {"nominal_gbit_per_s": 1.0, "wire_gbit_per_s": 0.95},
        "rows": [
            {"sparsifier": name, "parameters": 4000, "density": density, "step_ms": 50.0,
             "compute_ms": 40.0, "select_ms": 1.0, "exchange_ms": 8.0, "other_ms": 1.0}
            for name, density in (("dense", 1.0), ("micro", 0.05), ("ddp", None), ("none", None))
        ] + [{"sparsifier": "none@ddp", "step_ms": 55.0, "compute_ms": 45.0}],
    }], "machine": {"cores": 1}}))  # fmt: skip
    select = tmp_path / "select.json"  # what `bench select` wrote, for micro at d = 4000
    select.write_text(json.dumps({
        "rows": [{"device": "cpu", "sparsifier": "micro", "numel": 4000, "world_size": 2,
                  "overhead_ms": 5.0, "select_ms": 1.0}],
        "floors": [{"device": "cpu", "numel": 4000, "compensate_ms": 0.5}],
    }))  # fmt: skip
    out = tmp_path / "simulate"
    code = main([
        "simulate", "--workers", "1,4", "--capture", str(capture), "--steps", "3",
        "--warmup", "1", "--predict", "--predict-workers", "4,16", "--rates", "10,100",
        "--cluster-results", str(cluster), "--select-results", str(select), "--threads", "1",
        "--quiet", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    result = json.loads((out / "simulate.json").read_text())
    labels = [v.label for v in variants()]
    assert {(r["sparsifier"], r["world_size"]) for r in result["rows"]} == {
        (label, n) for label in labels for n in (1, 4)
    }
    assert result["numel"] == 4000 and result["noise_ratio"] > 0
    for row in result["rows"]:
        assert row["build_up"] >= 0 and row["bytes_per_worker"] >= 0 and row["padding"] >= 0
        if row["world_size"] == 1:
            assert row["bytes_per_worker"] == 0
        if row["exchange"] in ("exclusive", "shared", "dense"):
            assert row["overlap"] == pytest.approx(1.0 if row["exchange"] == "exclusive"
                                                   else row["world_size"])  # fmt: skip
    predicted = result["prediction"]["rows"]
    peer_names = peermodel.DEFAULT_PEERS
    assert len(predicted) == (len(labels) + len(peer_names)) * 2 * 2
    assert all(r["step_ms"] > 0 for r in predicted)
    peer_rows = {(r["sparsifier"], r["world_size"], r["gbit_per_s"]): r
                 for r in predicted if r.get("kind") == "peer"}  # fmt: skip
    assert {name for name, _, _ in peer_rows} == set(peer_names)
    ddp, powersgd = peer_rows[("ddp", 16, 10)], peer_rows[("powersgd", 16, 10)]
    assert ddp["bytes_per_worker"] == all_reduce_bytes(4 * RESNET18_NUMEL, 16)
    assert ddp["overhead_ms"] == 0 and ddp["step_ms"] == ddp["communication_ms"] > 0
    assert powersgd["bytes_per_worker"] < ddp["bytes_per_worker"] / 100
    assert peer_rows[("fp16", 16, 10)]["bytes_per_worker"] == ddp["bytes_per_worker"] // 2
    assert peer_rows[("ddp", 16, 100)]["communication_ms"] < ddp["communication_ms"]
    validated = result["validation"]["rows"]
    assert [r["sparsifier"] for r in validated] == ["dense", "micro"]
    [peer] = result["validation"]["peer_rows"]
    assert peer["sparsifier"] == "ddp" and peer["local_ms"] == 0
    # The peers run through DDP: their base is DDP without an exchange, not the bound, and
    # 2 hosts on the file's 1 core share it.
    assert (peer["base"], peer["shared_cores"]) == ("none@ddp", 2.0)
    assert peer["predicted_step_ms"] == pytest.approx(55.0 + peer["communication_ms"])
    assert peer["modelled_bytes"] == all_reduce_bytes(4 * RESNET18_NUMEL, 2)
    assert all(r["predicted_exchange_ms_probed"] > 0 for r in validated)
    micro = validated[1]
    assert micro["local_exchange_ms"] == pytest.approx(5.0 - 1.0 - 0.5)
    assert micro["predicted_step_ms_probed_plus_local"] == pytest.approx(
        40.0 + 1.0 + 1.0 + micro["predicted_exchange_ms_probed"] + 3.5
    )
    markdown = (out / "simulate.md").read_text()
    assert "| 2 | 1gbit | ddp |" in markdown
    # A run of the peers and hooks alone still shows the peers' comparison.
    alone = simulate.markdown_validation({**result["validation"], "rows": []})
    assert "| 2 | 1gbit | ddp |" in alone and "none@ddp" in alone
    for label in labels:
        assert len(table_rows(markdown, label)) == 2 + 2  # simulation rows + one per rate
    assert (out / "simulate.png").stat().st_size > 0 and (out / "predict.png").stat().st_size > 0
    # The model again, from the written simulation, without simulating.
    again = tmp_path / "again"
    code = main([
        "simulate", "--from", str(out / "simulate.json"), "--predict", "--algorithms", "best",
        "--predict-workers", "1024", "--no-plots", "--quiet", "--out", str(again),
    ])  # fmt: skip
    assert code == 0
    redone = json.loads((again / "simulate.json").read_text())
    assert redone["rows"] == result["rows"]
    assert {r["world_size"] for r in redone["prediction"]["rows"]} == {1024}


def test_simulate_compares_options_of_one_sparsifier(tmp_path):
    """``name(key=value,...)`` labels; quotas are balanced and at the ideal, a threshold is not."""
    capture = tmp_path / "capture"
    write_capture(capture, ranks=2, steps=4, sizes=(3000, 40, 960), scale=1e-3)
    out = tmp_path / "simulate"
    labels = ("micro(wire=plain),"
              "micro(selection=threshold,partitioning=contiguous,index_message=padded)")
    code = main([
        "simulate", "--workers", "4", "--capture", str(capture), "--density", "0.05",
        "--steps", "4", "--warmup", "1", "--sparsifiers", labels, "--value-dtype", "float32",
        "--no-plots", "--quiet", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    rows = {r["sparsifier"]: r for r in json.loads((out / "simulate.json").read_text())["rows"]}
    quota = rows["micro(wire=plain)"]
    threshold = rows["micro(selection=threshold,partitioning=contiguous,index_message=padded)"]
    assert threshold["options"] == {
        "selection": "threshold", "partitioning": "contiguous", "index_message": "padded"
    }  # fmt: skip
    assert quota["imbalance"] == 0 and quota["padding"] == 0 and quota["build_up_mean"] == 1.0
    # k = 200 over 4 ranks: the 8-byte guard, 50 indices each plus the 3-slot header, then
    # 200 values.
    assert quota["wire_ratio"] == pytest.approx(
        (3 * 8 + 3 * 53 * 4 + 2 * 3 / 4 * 200 * 4) / (9 * 200)
    )
    assert threshold["imbalance"] > 0.05 and threshold["wire_ratio"] > quota["wire_ratio"]
    bad = main(["simulate", "--sparsifiers", "micro(selection=top)", "--quiet",
                "--out", str(tmp_path / "bad")])  # fmt: skip
    assert bad == 2


def test_cost_model_on_a_hand_computed_example():
    network = costmodel.Network.of(gbit_per_s=8.0, latency_us=10.0)  # β = 1e9 bytes/s
    assert network.bandwidth == 1e9
    # Ring all-reduce of 1 MB over 4 workers: 2·3·(10 µs + 250 kB / 1 GB/s) = 1.56 ms.
    assert costmodel.all_reduce_seconds(1e6, 4, network) == pytest.approx(1.56e-3)
    # All-gather of 4 kB per rank over 4 workers: 3·(10 µs + 4 µs) = 42 µs.
    assert costmodel.all_gather_seconds(4000, 4, network) == pytest.approx(42e-6)
    # Broadcast of 1 MB to 8: tree 3·(10 µs + 1 ms) = 3.03 ms; chain 7·10 µs + 1 ms = 1.07 ms.
    assert costmodel.broadcast_seconds(1e6, 8, network) == pytest.approx(1.07e-3)
    assert costmodel.all_reduce_seconds(1e6, 1, network) == 0.0
    # The reference MiCRO step: the guard (8 B), header (16 B), padded indices (300 × 4 B),
    # values (1000 × 4 B), n = 4.
    shape = costmodel.StepShape("padded", numel=10**6, selected=1000, max_local_selected=300)
    expected = (3 * (10e-6 + 8e-9) + 3 * (10e-6 + 16e-9) + 3 * (10e-6 + 1.2e-6)
                + 6 * (10e-6 + 1e-6))  # fmt: skip
    assert costmodel.step_seconds(shape, 4, network, compute=0.02, overhead=0.001) == (
        pytest.approx(0.021 + expected)
    )
    # "best": small messages go by recursive doubling, 10 rounds instead of 2·1023 ring steps.
    assert costmodel.collective_seconds("all_reduce", 100, 1024, network, "best") == (
        pytest.approx(10 * (10e-6 + 100e-9))
    )
    assert costmodel.collective_seconds("all_reduce", 1e6, 4, network, "best") == (
        pytest.approx(1.56e-3)  # the ring is faster for 1 MB over 4 workers
    )
    doubled = costmodel.scaled(shape, 2 * 10**6)
    assert (doubled.selected, doubled.max_local_selected) == (2000, 600)


def test_capture_reader_reads_what_the_test_wrote(tmp_path):
    first = write_capture(tmp_path, ranks=2, steps=3)
    capture = load_capture(tmp_path)
    assert capture.ranks == [0, 1] and capture.steps == 3 and capture.layout.numel == 500
    assert capture.layout.names == ("layer0", "layer1", "layer2")
    assert capture.metadata["model"] == "tiny"
    assert torch.equal(capture.gradient(0, 0), first)
    mean = capture.mean_gradient(1)
    assert torch.allclose(mean, (capture.gradient(0, 1) + capture.gradient(1, 1)) / 2)


def test_capture_reader_names_what_is_wrong(tmp_path):
    with pytest.raises(CaptureError, match="no such directory"):
        load_capture(tmp_path / "absent")
    write_capture(tmp_path, ranks=1, steps=3)
    (tmp_path / "grad-rank0-step000001.pt").unlink()
    with pytest.raises(CaptureError, match="lacks steps \\[1\\]"):
        load_capture(tmp_path)
    torch.save(torch.zeros(7), tmp_path / "grad-rank0-step000001.pt")
    with pytest.raises(CaptureError, match="500 entries"):
        load_capture(tmp_path).gradient(0, 1)
    (tmp_path / "layout.json").unlink()
    with pytest.raises(CaptureError, match="layout.json is missing"):
        load_capture(tmp_path)


def test_reducer_over_symmetric_peers_sends_as_rank_0_of_n():
    layout = model_layout(10_000)
    parameters = [(name, torch.nn.Parameter(torch.zeros(shape)))
                  for name, shape in zip(layout.names, layout.shapes)]  # fmt: skip
    for _, p in parameters:
        p.grad = torch.randn(p.shape)
    reducer = GradientReducer(parameters, "topk", 0.01, collectives=SymmetricPeers(0, 8))
    stats = reducer.synchronize()
    assert stats.world_size == 8 and stats.local_selected == 100
    assert stats.selected == 100 and stats.proposed == 800  # identical peers: full overlap
    assert stats.bytes_sent > 0


def test_overhead_times_both_drivers_and_the_loopback_ratio(tmp_path):
    out = tmp_path / "overhead"
    code = main(["bench", "overhead", "--sizes", "70000", "--partitions", "1,4", "--repeats", "2",
                 "--loopback-ranks", "2", "--quiet", "--out", str(out)])  # fmt: skip
    assert code == 0
    result = json.loads((out / "overhead.json").read_text())
    assert [r["world_size"] for r in result["rows"]] == [1, 4]
    for row in result["rows"]:
        assert row["loop_passes"] > 0 and row["hook_passes"] > 0
        # Both selections do the same job: the quota's count, k/n of d = 70,000 at δ = 0.001.
        assert row["quota_count"] == row["reference_count"] == 70 // row["world_size"]
    (loop,) = result["loopback"]["rows"]
    assert loop["sparsifier"] == "micro" and loop["cpu_ratio"] > 0
    rounds = result["loopback"]["rounds"]
    assert rounds["index_round_wall_ms"] > 0 and rounds["value_round_wall_ms"] > 0
    text = (out / "overhead.md").read_text()
    assert "× all-reduce CPU" in text and "the index all-gather" in text


def test_overhead_times_a_variant_of_micro(tmp_path):
    out = tmp_path / "overhead"
    code = main(["bench", "overhead", "--sizes", "300000", "--partitions", "4", "--repeats", "2",
                 "--loopback-ranks", "2", "--quiet", "--out", str(out),
                 "--variant", "micro(wire=compact)"])  # fmt: skip
    assert code == 0
    result = json.loads((out / "overhead.json").read_text())
    (row,) = result["rows"]
    assert row["loop_passes"] > 0 and row["exchange_passes"] > 0
    assert result["loopback"]["rows"][0]["sparsifier"] == "micro(wire=compact)"
    assert "Loop, hook and loopback: micro(wire=compact)" in (out / "overhead.md").read_text()
    with pytest.raises(ValueError, match="must be micro with options"):
        OverheadConfig(variant="topk").options()


def test_the_simulator_counts_the_compact_wire_at_its_own_sizes(tmp_path):
    """Elias-Fano offsets and 8-bit values (on 4 ranks): under 0.4 of the plain wire's bytes,
    as the step sends."""
    code = main(["simulate", "--workers", "4", "--steps", "3", "--warmup", "1", "--numel",
                 "100000", "--sparsifiers", "micro(wire=plain),micro", "--no-plots",
                 "--quiet", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    plain, compact = json.loads((tmp_path / "simulate.json").read_text())["rows"]
    assert compact["exchange"] == "compact" and compact["shape"]["value_bytes"] == 1
    assert compact["bytes_per_worker"] < 0.4 * plain["bytes_per_worker"]
    shape = costmodel.StepShape(**compact["shape"])
    index = costmodel.reducer_collectives(shape, 4)[1]  # offsets, then the scale's word
    assert index == ("all_gather", 4 * -(-shape.max_local_selected // 2) + 4)


def test_the_simulator_counts_top_ks_fixed_union_at_n_k_values(tmp_path):
    """The same picks, so the same build-up, as the union's; no header round, and values at
    all n·k slots whatever the overlap."""
    code = main(["simulate", "--workers", "4", "--steps", "3", "--warmup", "1", "--numel",
                 "100000", "--density", "0.01", "--sparsifiers", "topk,topk(wire=fixed)",
                 "--no-plots", "--quiet", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    union, fixed = json.loads((tmp_path / "simulate.json").read_text())["rows"]
    assert (union["exchange"], fixed["exchange"]) == ("union", "fixed_union")
    assert fixed["build_up_mean"] == union["build_up_mean"] > 1
    k, n = 1000, 4
    assert fixed["bytes_per_worker"] == 3 * 8 + 3 * k * 4 + 2 * 3 / 4 * n * k * 4


def test_loopback_needs_a_warm_up_step_to_size_the_bare_rounds():
    from microsparse_lab.bench.loopback import LoopbackConfig

    with pytest.raises(ValueError, match="warmup: must be at least 1"):
        LoopbackConfig(warmup=0)
    with pytest.raises(ValueError, match="repeats: must be at least 1"):
        LoopbackConfig(repeats=0)
