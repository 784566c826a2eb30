"""Density warm-up: k follows the schedule at every step, in the loop API and the DDP hook."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import microsparse.ddp as mddp
from distributed import run_ranks
from microsparse import GradientReducer
from microsparse.errors import ConfigMismatchError
from microsparse.sparsifiers.warmup import DensityWarmup
from microsparse_lab.training.config import ConfigError, TrainConfig
from reference import micro_reference

SHAPES = [(300,), (20, 30), (113,)]
NUMEL = 1013
DENSITY, WARMUP = 0.01, DensityWarmup(start=0.2, steps=6)
STEPS = 10


def scheduled(numel: int = NUMEL) -> list[int]:
    final = math.floor(DENSITY * numel)
    return [WARMUP.target(t, DENSITY, final, numel) for t in range(STEPS)]


def test_the_schedule_decays_exponentially_and_says_what_it_costs() -> None:
    ks = scheduled()
    assert ks[0] == math.floor(0.2 * NUMEL) and ks[WARMUP.steps :] == [10] * 4
    assert all(a > b for a, b in zip(ks[: WARMUP.steps], ks[1 : WARMUP.steps + 1]))
    ratios = [WARMUP.density(t + 1, DENSITY) / WARMUP.density(t, DENSITY) for t in range(5)]
    np.testing.assert_allclose(ratios, (DENSITY / 0.2) ** (1 / 6))
    expected = (sum(WARMUP.density(t, DENSITY) for t in range(6)) + 94 * DENSITY) / 100
    assert WARMUP.mean_density(DENSITY, 100) == pytest.approx(expected)
    for bad in [(0.0, 5), (1.5, 5), (0.1, 0), (0.1, 2.5), "0.1"]:
        with pytest.raises(ValueError, match="density_warmup"):
            DensityWarmup.of(bad)
    with pytest.raises(ValueError, match="must be above the density"):
        GradientReducer([torch.zeros(10, requires_grad=True)], "micro", 0.5,
                        density_warmup=(0.1, 5))  # fmt: skip
    with pytest.raises(ValueError, match="averages densely"):
        GradientReducer([torch.zeros(10, requires_grad=True)], "dense", 0.5,
                        density_warmup=(0.9, 5))  # fmt: skip
    with pytest.raises(ConfigError, match="density_warmup"):
        TrainConfig(density=0.01, density_warmup=(0.005, 1.0)).resolved()


def gradients(n: int, seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(NUMEL) for _ in range(n)] for _ in range(STEPS)]


SPARSIFIERS = ["micro", "topk", "cltk", "deft", "sage", "hard_threshold", "oracle"]


def loop_worker(rank: int, n: int) -> dict:
    out = {}
    for name in SPARSIFIERS:
        params = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in SHAPES]
        wire = {"wire": "plain"} if name == "micro" else {}  # float64 values to the bit
        reducer = GradientReducer(params, name, DENSITY, density_warmup=WARMUP, **wire)
        steps = []
        for flat in gradients(n, 1):
            for p, chunk in zip(params, torch.from_numpy(flat[rank]).split([300, 600, 113])):
                p.grad = chunk.view(p.shape).clone()
            stats = reducer.synchronize()
            steps.append({
                "target": stats.target, "selected": stats.selected,
                "aggregated": torch.cat([p.grad.flatten() for p in params]).numpy().copy(),
                "residual": reducer.residual.numpy().copy(),
            })  # fmt: skip
        out[name] = steps
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_every_sparsifier_follows_the_schedule_and_micro_matches_the_reference(n, tmp_path):
    ranks = run_ranks(loop_worker, n, tmp_path)
    ks = scheduled()
    for name in SPARSIFIERS:
        for t in range(STEPS):
            assert ranks[0][name][t]["target"] == ks[t], (name, t)
    for name in ("micro", "cltk", "oracle"):  # exclusive or shared: exactly k at every step
        assert [step["selected"] for step in ranks[0][name]] == ks, name
    # DEFT rounds each layer's share of k: at most one entry per layer short.
    assert all(0 <= k - s["selected"] <= 3 for k, s in zip(ks, ranks[0]["deft"]))
    expected = micro_reference(gradients(n, 1), DENSITY, "quota", "interleaved", targets=ks)
    for t, want in enumerate(expected):
        for r in range(n):
            got = ranks[r]["micro"][t]
            np.testing.assert_allclose(got["aggregated"], want["aggregated"], rtol=1e-12,
                                       atol=1e-15, err_msg=f"step {t}")  # fmt: skip
            np.testing.assert_allclose(got["residual"], want["residuals"][r], rtol=1e-12,
                                       atol=1e-15, err_msg=f"step {t}")  # fmt: skip


def resume_worker(rank: int, n: int) -> list[bool]:
    data = gradients(n, 2)

    def run(reducer, params, steps) -> None:
        for t in steps:
            for p, chunk in zip(params, torch.from_numpy(data[t][rank]).split([300, 600, 113])):
                p.grad = chunk.view(p.shape).clone()
            reducer.synchronize()

    params = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in SHAPES]
    reducer = GradientReducer(params, "micro", DENSITY, density_warmup=WARMUP,
                              selection="threshold")  # fmt: skip
    run(reducer, params, range(3))
    saved = reducer.state_dict()
    run(reducer, params, range(3, STEPS))
    again = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in SHAPES]
    resumed = GradientReducer(again, "micro", DENSITY, density_warmup=WARMUP,
                              selection="threshold")  # fmt: skip
    resumed.load_state_dict(saved)
    run(resumed, again, range(3, STEPS))
    return [
        torch.equal(reducer.residual, resumed.residual),
        all(torch.equal(a.grad, b.grad) for a, b in zip(params, again)),
        resumed.last_step.target == reducer.last_step.target == 10,
    ]


def test_a_run_resumed_inside_the_warmup_continues_exactly(tmp_path) -> None:
    for result in run_ranks(resume_worker, 2, tmp_path):
        assert result == [True, True, True]


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(40, 50), nn.Linear(50, 30)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def ddp_worker(rank: int, n: int) -> list[tuple[int, int]]:
    torch.manual_seed(0)
    model = Wide().double()
    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets, rebuilt after the first pass
    state = mddp.MicroState(DENSITY, density_warmup=WARMUP)
    ddp.register_comm_hook(state, mddp.micro_hook)
    generator = torch.Generator().manual_seed(rank)
    seen = []
    for _ in range(STEPS):
        ddp.zero_grad()
        ddp(torch.randn(8, 40, generator=generator, dtype=torch.float64)).pow(2).sum().backward()
        seen.append((state.last_step.target, state.last_step.selected))
    return seen


def test_the_hook_follows_the_schedule_through_the_rebuild(tmp_path) -> None:
    numel = sum(p.numel() for p in Wide().parameters())
    ks = scheduled(numel)
    for seen in run_ranks(ddp_worker, 2, tmp_path):
        assert seen == [(k, k) for k in ks]  # the slabs' ks add up to the model's k


def hook_mismatch_worker(rank: int, n: int) -> str:
    torch.manual_seed(0)
    ddp = DDP(Wide(), bucket_cap_mb=0.01)
    state = mddp.MicroState(DENSITY, density_warmup=WARMUP)
    ddp.register_comm_hook(state, mddp.micro_hook)
    state.step = 2 if rank == 1 else 0  # resumed from another rank's checkpoint
    try:
        ddp(torch.randn(8, 40)).sum().backward()
    except ConfigMismatchError as error:
        return str(error)
    return "no error"


def test_a_rank_at_another_step_inside_the_warmup_is_told_not_aborted(tmp_path) -> None:
    # Each step of a warm-up has its own k, so its own index-message size; the round that
    # checks the step must keep one size anyway, or gloo aborts the process.
    for message in run_ranks(hook_mismatch_worker, 2, tmp_path):
        assert "different number of times (steps per rank: [0, 2])" in message, message


def test_train_counts_the_warmup_in_the_mean_density(tmp_path) -> None:
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "microsparse_lab", "train", "--workers", "2", "--max-steps", "6",
         "--density", "0.001", "--density-warmup", "0.01,0.1", "--no-progress",
         "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    densities = [r["selected"] / r["numel"] for r in records]
    assert densities[0] > 5 * densities[-1]  # 0.1 epoch of 62 steps: 6 steps of warm-up
    assert summary["mean_density"] == pytest.approx(sum(densities) / len(densities))
    assert summary["sends_per_entry"] == pytest.approx(sum(densities))  # warm-up included
    assert "mean density K/d over the run" in result.stdout
    assert f"sent {summary['sends_per_entry']:.3g} times in 6 steps" in result.stdout
