"""The hook's ``min_speedup``: it times sparse and dense passes, every rank takes the same
choice, and nothing the residuals held is lost when it averages densely."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import microsparse.ddp as mddp
from distributed import run_ranks
from microsparse import ConfigMismatchError
from microsparse.ddp.choice import CHOICE_PASS, PROBE_PASSES, SETTLING_PASSES, SpeedChoice


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 40), nn.ReLU(), nn.Linear(40, 30), nn.ReLU(),
                         nn.Linear(30, 4)).double()  # fmt: skip


def batch(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 12, generator=generator, dtype=torch.float64) * 3


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def conserving_worker(rank: int, n: int, min_speedup: float, passes: int,
                      resume: list[tuple[dict, torch.Tensor]] | None = None,
                      ddp_flags: dict[str, bool] | None = None) -> dict:  # fmt: skip
    """Train ``passes`` steps through the hook; at every pass check, against every rank's
    own gradient and residual gathered by hand, that n · average + Σ residual after the pass
    equals Σ (gradient + residual before it). ``resume``: each rank's saved state, and its
    residuals then in the model's order. Returns the modes and the choice."""
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=0.002, **(ddp_flags or {}))  # several buckets
    # the plain wire conserves to the bit (the compact one's bfloat16 sum rounds once)
    state = mddp.SparseState("micro", 0.05, min_speedup=min_speedup, wire="plain")
    if resume is not None:
        state.load_state_dict(resume[rank][0])
    ddp.register_comm_hook(state, mddp.sparse_hook)
    local = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    before = resume[rank][1] if resume else torch.zeros(sum(p.numel() for p in params),
                                                        dtype=torch.float64)  # fmt: skip
    modes, worst, saved = [], 0.0, None
    for step in range(passes):
        local.load_state_dict(model.state_dict())
        local.zero_grad()
        local(batch(step, rank)).pow(2).mean().backward()
        sent = flat(p.grad for p in local.parameters()) + before
        optimizer.zero_grad()
        ddp(batch(step, rank)).pow(2).mean().backward()
        after = flat(state.residual(p) for p in params)
        both = torch.stack([sent, after])
        gathered = [torch.empty_like(both) for _ in range(n)]
        dist.all_gather(gathered, both)
        total_sent = sum(g[0] for g in gathered)
        total_kept = sum(g[1] for g in gathered)
        averaged = flat(p.grad for p in params)
        worst = max(worst, float((n * averaged + total_kept - total_sent).abs().max()))
        stats = state.last_step
        modes.append("dense" if stats.extra.get("averaging") == "dense" else "sparse")
        if modes[-1] == "dense":
            assert stats.selected == stats.numel and float(after.abs().max()) == 0.0
        else:
            assert stats.selected < stats.numel
        optimizer.step()
        before = after.clone()
        if step == SETTLING_PASSES:  # a sparse probe pass: residuals held, no choice yet
            saved = (state.state_dict(), after.clone())
    return {"modes": modes, "worst": worst, "choice": state.speed.choice,
            "medians": state.speed.medians, "saved": saved, "step": state.step}  # fmt: skip


@pytest.mark.parametrize("flags", [{}, {"gradient_as_bucket_view": True, "static_graph": True}])
def test_every_rank_probes_then_takes_one_choice_and_loses_nothing(flags, tmp_path) -> None:
    passes = CHOICE_PASS + 3
    probe = ["sparse", "dense"] * PROBE_PASSES
    for min_speedup, choice in ((1e6, "dense"), (1e-6, "sparse")):
        results = run_ranks(conserving_worker, 2, tmp_path, min_speedup, passes, None, flags)
        for result in results:
            assert result["modes"] == ["sparse"] * SETTLING_PASSES + probe + [choice] * 3
            assert result["choice"] == choice
            assert result["worst"] < 1e-12
            assert result["step"] == passes  # dense passes count as steps too
            assert len(result["medians"]) == 2 and all(
                len(row) == 2 and all(0 < s < 60 for s in row) for row in result["medians"])
        assert results[0]["medians"] == results[1]["medians"]  # every rank chose from these


def test_a_taken_choice_holds_on_resume_and_sends_the_saved_residuals(tmp_path) -> None:
    """A state saved mid-probe (residuals held) and marked dense resumes dense from its
    first pass, with no new probe, and sends what its residuals held (conservation)."""
    first = run_ranks(conserving_worker, 2, tmp_path, 1.0, SETTLING_PASSES + 1)
    saved = [result["saved"] for result in first]
    assert all(residuals.abs().max() > 0 for _, residuals in saved)
    for state, _ in saved:
        state["speed"] = {"choice": "dense", "medians": [[1.0, 0.5], [1.0, 0.5]]}
    resumed = run_ranks(conserving_worker, 2, tmp_path, 1.0, 3, saved)
    for result in resumed:
        assert result["modes"] == ["dense"] * 3
        assert result["worst"] < 1e-12


def mismatch_worker(rank: int, n: int) -> str:
    ddp = DDP(mlp())
    ddp.register_comm_hook(mddp.SparseState("micro", 0.05 * (rank + 1)), mddp.sparse_hook)
    try:
        ddp(batch(0, rank)).sum().backward()
    except ConfigMismatchError as error:
        return str(error)
    return "no error"


def test_ranks_with_other_options_fail_at_the_first_pass_instead_of_hanging(tmp_path) -> None:
    for message in run_ranks(mismatch_worker, 2, tmp_path):
        assert "ranks disagree on the DDP hook's options" in message
        assert "density (rank 0: 0.05, rank 1: 0.1)" in message, message


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "fast", True])
def test_min_speedup_refuses_what_is_not_a_positive_number(value) -> None:
    with pytest.raises(ValueError, match="min_speedup must be None"):
        mddp.MicroState(0.01, min_speedup=value)


@pytest.mark.parametrize("options, named", [
    ({"momentum_correction": 0.9}, "momentum_correction"),
    ({"adam_correction": (0.9, 0.999, 1e-8)}, "adam_correction"),
    ({"nonfinite": "raise"}, "nonfinite='raise'"),
    ({"density": 1.0}, "density 1"),
])  # fmt: skip
def test_min_speedup_refuses_options_that_need_every_pass_sparse(options, named) -> None:
    arguments = {"density": 0.01, **options}
    with pytest.raises(ValueError, match=f"min_speedup.*{named}"):
        mddp.SparseState("micro", min_speedup=1.1, **arguments)


def test_the_choice_sums_every_ranks_medians() -> None:
    # Rank 1 is far slower dense: the sums decide, not a vote of ranks.
    rows = [[0.030, 0.031], [0.030, 0.300]]
    assert SpeedChoice.decide(rows, 1.1) == "sparse"
    assert SpeedChoice.decide([[0.030, 0.031], [0.030, 0.031]], 1.1) == "dense"
    assert SpeedChoice.decide([[0.030, 0.031], [0.030, 0.031]], 1.0) == "sparse"


def test_the_probe_times_the_whole_step_between_pass_ends() -> None:
    choice = SpeedChoice(1.1)
    gathered = []

    def all_gather(mine: torch.Tensor) -> torch.Tensor:
        gathered.append(mine)
        return mine.unsqueeze(0)

    for _ in range(CHOICE_PASS):
        choice.end_pass(choice.begin_pass(all_gather))
    assert choice.choice is None and not gathered
    choice.begin_pass(all_gather)
    (mine,) = gathered
    assert mine.dtype == torch.float64 and mine.shape == (2,) and bool((mine > 0).all())
    assert choice.choice in ("sparse", "dense")
    with pytest.raises(ValueError, match="choice must be one of"):
        choice.load_state_dict({"choice": "fastest"})
