"""GradientReducer behaviour beyond the MiCRO rule: resuming, dtypes, unused parameters."""

from __future__ import annotations

import torch

from distributed import run_ranks
from microsparse import GradientReducer


def gradient(step: int, rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + rank))


def resume_worker(rank: int, n: int, steps: int, stop_at: int) -> dict:
    def fresh() -> tuple[torch.Tensor, GradientReducer]:
        param = torch.zeros(300, requires_grad=True)
        return param, GradientReducer([param], "micro", 0.02)

    param, reducer = fresh()
    for step in range(steps):
        if step == stop_at:  # checkpoint, throw everything away, rebuild, restore
            state = reducer.state_dict()
            param, reducer = fresh()
            reducer.load_state_dict(state)
        param.grad = gradient(step, rank, 300)
        reducer.synchronize()
    return {
        "grad": param.grad.clone(),
        "residual": reducer.residual.clone(),
        "threshold": reducer.sparsifier.threshold,
    }


def test_resumed_reducer_continues_exactly(tmp_path) -> None:
    uninterrupted = run_ranks(resume_worker, 2, tmp_path / "a", 8, -1)
    resumed = run_ranks(resume_worker, 2, tmp_path / "b", 8, 5)
    for a, b in zip(uninterrupted, resumed):
        assert torch.equal(a["grad"], b["grad"])
        assert torch.equal(a["residual"], b["residual"])
        assert a["threshold"] == b["threshold"]


def test_state_from_another_setup_is_refused() -> None:
    state = GradientReducer([torch.zeros(10, requires_grad=True)], "micro", 0.1).state_dict()
    other = GradientReducer([torch.zeros(10, requires_grad=True)], "micro", 0.2)
    try:
        other.load_state_dict(state)
    except ValueError as error:
        assert "different layout, sparsifier, density or options" in str(error)
    else:
        raise AssertionError("load_state_dict accepted a state of another density")


def test_half_precision_parameters_keep_a_float32_residual() -> None:
    param = torch.zeros(1000, dtype=torch.bfloat16, requires_grad=True)
    reducer = GradientReducer([param], "micro", 0.01)
    fresh = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e-3
    param.grad = fresh.to(torch.bfloat16)
    reducer.synchronize()
    assert reducer.residual.dtype == torch.float32
    assert param.grad.dtype == torch.bfloat16
    # Nothing is lost: what was sent plus what was kept is what came in (one worker).
    sent = param.grad.float()
    torch.testing.assert_close(
        sent + reducer.residual, fresh.to(torch.bfloat16).float(), rtol=1e-2, atol=0
    )


def test_unused_parameter_counts_as_zero_gradient_and_receives_the_average() -> None:
    used, unused = torch.zeros(50, requires_grad=True), torch.zeros(50, requires_grad=True)
    reducer = GradientReducer([used, unused], "micro", 1.0)
    used.grad = torch.ones(50)
    reducer.synchronize()
    assert unused.grad is not None and torch.equal(unused.grad, torch.zeros(50))
    assert torch.equal(used.grad, torch.ones(50))
