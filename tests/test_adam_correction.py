"""Adam correction: each worker's own Adam step is what the error feedback accumulates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed import run_ranks
from microsparse import GradientReducer
from microsparse.feedback import ErrorFeedback, check_adam
from microsparse.layout import Layout

BETAS = (0.25, 0.9949, 1e-8)


def test_the_residual_accumulates_each_workers_bias_corrected_adam_step() -> None:
    layout = Layout.of([("w", torch.zeros(3)), ("b", torch.zeros(2))])
    memory = ErrorFeedback(layout, torch.float64, torch.device("cpu"), adam=BETAS)
    m, v, e = np.zeros(5), np.zeros(5), np.zeros(5)
    generator = np.random.default_rng(0)
    for step in range(6):
        g = generator.normal(size=5)
        if step == 4:  # an unused parameter: no gradient, counted as zero
            g[3:] = 0
            memory.compensate([torch.tensor(g[:3]), None], step)
        elif step % 2:  # a slab's gradient as one flat tensor
            memory.compensate(torch.tensor(g), step)
        else:
            memory.compensate([torch.tensor(g[:3]), torch.tensor(g[3:])], step)
        b1, b2, eps = BETAS
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        t = step + 1
        e = e + (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        sent = [step % 5]
        assert np.allclose(memory.accumulated.numpy(), e, rtol=1e-12, atol=0)
        memory.forget(torch.tensor(sent))
        e[sent] = 0  # sent; the moments keep their history (no masking)
        assert np.allclose(memory.residual.numpy(), e, rtol=1e-12, atol=0)
        assert np.allclose(memory.moments[0].numpy(), m) and np.allclose(
            memory.moments[1].numpy(), v
        )


def test_a_skipped_step_leaves_the_moments() -> None:
    layout = Layout.of([("w", torch.zeros(4))])
    memory = ErrorFeedback(layout, torch.float64, torch.device("cpu"), adam=BETAS)
    memory.compensate([torch.ones(4, dtype=torch.float64)], 0)
    before = [t.clone() for t in (memory.residual, *memory.moments)]
    poisoned = torch.tensor([5.0, float("nan"), 1.0, float("inf")], dtype=torch.float64)
    memory.compensate([poisoned], 1, skip=torch.ones(1))
    after = [t for t in (memory.residual, *memory.moments)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize(
    ("adam", "error"),
    [((0.9, 1.0, 1e-8), ValueError), ((0.9, 0.99), TypeError), ((0.9, 0.99, 0.0), ValueError)],
)
def test_bad_adam_options_name_the_option(adam, error) -> None:
    with pytest.raises(error, match="adam_correction"):
        check_adam(adam)


def reducer_worker(rank: int, n: int) -> list[bool]:
    """Two ranks, a brute-force reference of every rank's moments and residual."""
    torch.manual_seed(0)
    model = torch.nn.Linear(30, 4).double()
    # the plain wire: the residual is 0 where sent (the compact wire keeps bfloat16's rounding)
    reducer = GradientReducer(model, "micro", 0.1, adam_correction=BETAS, wire="plain")
    resumed_at, saved = 3, None
    generator = torch.Generator().manual_seed(rank)
    b1, b2, eps = BETAS
    m = v = e = torch.zeros(reducer.layout.numel, dtype=torch.float64)
    checks = []
    for step in range(6):
        model.zero_grad()
        model(torch.randn(5, 30, generator=generator, dtype=torch.float64)).pow(2).sum().backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if step == resumed_at:
            saved = reducer.state_dict()
        reducer.synchronize()
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        t = step + 1
        a = e + (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        sent = torch.cat([p.grad.reshape(-1) for p in model.parameters()]) != 0
        e = torch.where(sent, torch.zeros_like(a), a)
        checks.append(torch.allclose(reducer.residual, e, rtol=1e-12, atol=1e-15))
    again = GradientReducer(model, "micro", 0.1, adam_correction=BETAS, wire="plain")
    again.load_state_dict(saved)
    checks.append(all(torch.equal(x, y) for x, y in zip(again.moments,
                                                        saved["moments"])))  # fmt: skip
    return checks


def test_the_reducer_accumulates_adam_steps_and_resumes_them(tmp_path) -> None:
    for checks in run_ranks(reducer_worker, 2, tmp_path):
        assert checks == [True] * 7


def test_adam_correction_refuses_a_grad_scaler_and_dense_averaging() -> None:
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="adam_correction"):
        GradientReducer(model, "micro", 0.5, adam_correction=BETAS,
                        grad_scaler=torch.amp.GradScaler("cpu"))  # fmt: skip
