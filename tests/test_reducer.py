"""GradientReducer behaviour beyond the MiCRO rule: resuming, dtypes, unused parameters."""

from __future__ import annotations

import pytest
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


def test_fixed_index_message_defers_the_smallest_overflow_to_the_residual() -> None:
    param = torch.zeros(10_000, requires_grad=True)
    # λ_0 = 1/(2·sqrt(100)) = 0.05 is far too low for N(0, 1) gradients: most entries pass.
    reducer = GradientReducer([param], "micro", 0.01, threshold_rule="symmetric")
    fresh = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    param.grad = fresh.clone()
    stats = reducer.synchronize()
    capacity = reducer.sparsifier.capacity  # ceil(1.25 · 100 / 1) + 8
    assert capacity == 133 and stats.selected == capacity
    assert stats.proposed == int((fresh.abs() >= stats.threshold).sum()) > capacity
    sent = param.grad != 0
    assert torch.equal(
        fresh.abs()[sent].sort().values, fresh.abs().topk(capacity).values.sort().values
    )
    assert torch.equal(param.grad + reducer.residual, fresh)  # nothing lost


def half_values_worker(rank: int, n: int, dtype: torch.dtype) -> dict:
    param = torch.zeros(4000, dtype=torch.float64, requires_grad=True)
    reducer = GradientReducer([param], "micro", 0.02, value_dtype=dtype)
    fresh = gradient(0, rank, 4000).double()
    param.grad = fresh.clone()
    stats = reducer.synchronize()
    return {
        "fresh": fresh,
        "grad": param.grad.clone(),
        "residual": reducer.residual.clone(),
        "stats": stats,
    }


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_values_leave_their_rounding_in_the_residual(dtype, tmp_path) -> None:
    ranks = run_ranks(half_values_worker, 2, tmp_path, dtype)
    sent = ranks[0]["grad"] != 0
    assert sent.sum() == ranks[0]["stats"].selected > 0
    wire = [r["fresh"][sent].to(dtype) for r in ranks]
    for r, result in enumerate(ranks):
        # Each rank keeps exactly what rounding its own values to the wire dtype removed.
        assert torch.equal(result["residual"][sent], result["fresh"][sent] - wire[r].double())
        assert torch.equal(result["residual"][~sent], result["fresh"][~sent])
        assert torch.equal(result["grad"], ranks[0]["grad"])
    # The average is the wire sum (rounded once more in the wire dtype) over n.
    expected = (wire[0] + wire[1]).double() / 2
    torch.testing.assert_close(ranks[0]["grad"][sent], expected, rtol=0, atol=0)


def test_value_dtype_is_checked() -> None:
    with pytest.raises(
        ValueError, match="value_dtype must be None, torch.float16, torch.bfloat16 or torch.int8"
    ):
        GradientReducer([torch.zeros(3, requires_grad=True)], "micro", 0.5,
                        value_dtype=torch.float64)  # fmt: skip
