"""``microsparse simulate``'s default stays small, shows its progress, and shares the union."""

from __future__ import annotations

import json

import torch

from microsparse.sparsifiers.threshold import initial_threshold
from microsparse_lab.bench import simulate
from microsparse_lab.bench.virtual import SharedUnion, VirtualCluster
from microsparse_lab.bench.workload import model_layout
from microsparse_lab.cli import build_parser, main
from microsparse_lab.cli import simulate as simulate_cli
from microsparse_lab.methods.names import variants


def test_the_readme_command_simulates_a_bounded_plan():
    """``microsparse simulate --predict``: n ≤ 64, a fixed number of worker-steps, < 2 GB of
    residuals; the exact run up to n = 1024 stays one flag away."""
    args = build_parser().parse_args(["simulate", "--predict"])
    config = simulate_cli.config_from(args)
    assert config.workers == simulate.DEFAULT_WORKERS == (1, 4, 16, 64)
    plan = simulate.Plan(len(variants(config.density)), config.workers, config.steps,
                         config.numel)  # fmt: skip
    assert plan.runs == len(variants(config.density)) * 4
    assert plan.worker_steps == len(variants(config.density)) * (1 + 4 + 16 + 64) * config.steps
    assert plan.residual_bytes == 64 * simulate.SMALLCNN_NUMEL * 4 < 2e9 / 20
    exact = build_parser().parse_args(["simulate", "--workers", "1,4,16,64,256,1024"])
    assert simulate_cli.config_from(exact).workers == simulate.EXACT_WORKERS
    assert "--workers 1,4,16,64,256,1024 simulates every n it predicts" in _simulate_help()


def _simulate_help() -> str:
    parser = build_parser()
    action = next(a for a in parser._subparsers._actions if a.choices)  # type: ignore[union-attr]
    return " ".join(action.choices["simulate"].format_help().split())


def test_progress_goes_to_stderr_and_quiet_silences_it(tmp_path, capsys):
    argv = ["simulate", "--workers", "1,4", "--numel", "5000", "--steps", "2", "--warmup", "0",
            "--sparsifiers", "micro,topk", "--no-plots"]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "loud")]) == 0
    captured = capsys.readouterr()
    # The plan first: 2 sparsifiers × (1 + 4) workers × 2 steps = 20 worker-steps.
    plan = "simulating 2 sparsifiers × n = 1,4 × 2 steps at d = 5,000: 4 runs, 20 worker-steps;"
    assert plan in captured.err
    assert "20/20" in captured.err and "worker-step" in captured.err  # tqdm's done/total
    assert "topk n=4" in captured.out and "20/20" not in captured.out
    assert main([*argv, "--quiet", "--out", str(tmp_path / "quiet")]) == 0
    captured = capsys.readouterr()
    assert "worker-step" not in captured.err and "simulating" not in captured.err


def test_union_is_shared_yet_each_worker_keeps_its_own_counts():
    """hard_threshold's ranks pick different counts; the union computed once must still be
    every rank's own: each residual forgets exactly the union, counts are each rank's."""
    numel, world_size, density = 20_000, 4, 0.01
    cluster = VirtualCluster("hard_threshold", density, model_layout(numel), world_size)
    assert all(isinstance(engine.framing, SharedUnion) for engine in cluster.engines)
    threshold = initial_threshold(cluster.target)
    scale = threshold / 2.5  # about 1 % of entries pass, a different count on every rank

    def gradient(rank: int) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * scale

    def gradient_for(rank: int, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(gradient(rank))

    record = cluster.step(gradient_for)
    passing = [gradient(rank).abs() >= threshold for rank in range(world_size)]
    union = torch.stack(passing).any(dim=0)
    assert record.counts == [int(p.sum()) for p in passing]
    assert len(set(record.counts)) > 1
    assert record.selected == int(union.sum()) < sum(record.counts)
    for rank in range(world_size):
        expected = torch.where(union, torch.zeros(numel), gradient(rank))
        assert torch.equal(cluster.residual(rank), expected)


def test_a_prediction_beyond_the_simulated_n_says_so(tmp_path):
    config = simulate.SimulateConfig(workers=(1, 4), numel=5_000, steps=2, warmup=0,
                                     only=("micro", "topk"))  # fmt: skip
    result = simulate.run(config, progress=False)
    model = simulate.PredictConfig(rates_gbit=(10.0,), workers=(4, 16, 64), peers=())
    prediction = simulate.predict(result, model)
    assert prediction["beyond_simulated"] == [16, 64]
    assert {(r["world_size"], r["simulated_at"]) for r in prediction["rows"]} == {
        (4, 4), (16, 4), (64, 4)
    }
    text = simulate.markdown_prediction(json.loads(json.dumps(prediction)))
    assert "n = 16, 64 not simulated" in text and "--workers 1,4,16,64,256,1024" in text
    within = simulate.predict(result, simulate.PredictConfig(workers=(4,), peers=()))
    assert within["beyond_simulated"] == []
    assert "not simulated" not in simulate.markdown_prediction(within)
