"""Momentum correction: each worker's velocity, not its gradient, goes into the residual.

Against the brute-force reference (``micro_reference(..., momentum=m)``) on real gloo ranks:
every step's average, residual and velocity; conservation of what was accumulated; masking
of the velocity wherever a value was sent; exact resume; a failed transactional step that
leaves both buffers untouched; and the options' errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from distributed import run_ranks
from microsparse import GradientReducer, NonFiniteGradientError
from microsparse_lab.training.config import ConfigError, TrainConfig
from reference import micro_reference

SHAPES = [(30,), (7, 8), (17,)]
STEPS = 12
CASES = [  # (momentum, nesterov, reference rule, reducer options)
    (0.9, False, "quota", {}),
    (0.9, True, "quota", {}),
    (0.5, False, "as_coded", {"threshold_rule": "as_coded", "partitioning": "contiguous",
                              "index_message": "padded"}),
]  # fmt: skip


def gradients_for(n: int, seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    numel = sum(math.prod(s) for s in SHAPES)
    return [[rng.standard_normal(numel) for _ in range(n)] for _ in range(STEPS)]


def make(params: list[torch.Tensor], momentum: float, nesterov: bool, options: dict, **more):
    # float64 values to the bit: the plain wire (the compact one rounds them to bfloat16)
    return GradientReducer(params, "micro", 0.1, momentum_correction=momentum,
                           momentum_nesterov=nesterov, wire="plain", **options, **more)  # fmt: skip


def set_gradients(params: list[torch.Tensor], flat: np.ndarray) -> None:
    chunks = torch.from_numpy(flat).split([p.numel() for p in params])
    for p, chunk in zip(params, chunks):
        p.grad = chunk.view(p.shape).clone()


def reference_worker(rank: int, n: int) -> list[list[dict]]:
    results = []
    for index, (momentum, nesterov, _, options) in enumerate(CASES):
        params = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in SHAPES]
        reducer = make(params, momentum, nesterov, options)
        steps = []
        for step_gradients in gradients_for(n, index):
            set_gradients(params, step_gradients[rank])
            reducer.synchronize()
            steps.append({
                "aggregated": torch.cat([p.grad.flatten() for p in params]).numpy().copy(),
                "residual": reducer.residual.numpy().copy(),
                "velocity": reducer.velocity.numpy().copy(),
            })  # fmt: skip
        results.append(steps)
    return results


@pytest.mark.parametrize("n", [1, 2, 4])
def test_matches_the_reference_and_conserves_what_was_accumulated(n: int, tmp_path) -> None:
    ranks = run_ranks(reference_worker, n, tmp_path)
    for index, (momentum, nesterov, rule, options) in enumerate(CASES):
        partitioning = options.get("partitioning", "interleaved")
        gradients = gradients_for(n, index)
        expected = micro_reference(gradients, 0.1, rule, partitioning, None, momentum, nesterov)
        total_in = np.zeros_like(gradients[0][0])
        total_out = np.zeros_like(total_in)
        for t, want in enumerate(expected):
            where = f"case {index}, step {t}"
            for r in range(n):
                got = ranks[r][index][t]
                np.testing.assert_allclose(got["aggregated"], want["aggregated"], rtol=1e-12,
                                           atol=1e-15, err_msg=where)  # fmt: skip
                np.testing.assert_allclose(got["residual"], want["residuals"][r], rtol=1e-12,
                                           atol=1e-15, err_msg=where)  # fmt: skip
                np.testing.assert_allclose(got["velocity"], want["velocities"][r], rtol=1e-12,
                                           atol=1e-15, err_msg=where)  # fmt: skip
                # Factor masking: where a value was sent, residual and velocity restart at 0.
                sent = got["residual"] == 0
                assert sent.sum() == want["selected"], where
                assert np.all(got["velocity"][sent] == 0), where
            # Conservation: everything accumulated is sent (n · average) or still kept.
            total_in += sum(want["increments"])
            total_out += n * ranks[0][index][t]["aggregated"]
            kept = sum(ranks[r][index][t]["residual"] for r in range(n))
            np.testing.assert_allclose(total_out + kept, total_in, rtol=1e-10, atol=1e-10)
        # The velocity makes a difference (the test would pass for m = 0 otherwise).
        plain = micro_reference(gradients, 0.1, rule, partitioning)
        assert not np.allclose(plain[-1]["aggregated"], expected[-1]["aggregated"])


def resume_worker(rank: int, n: int) -> list[bool]:
    gradients = gradients_for(n, 7)

    def run(reducer, params, steps) -> None:
        for t in steps:
            set_gradients(params, gradients[t][rank])
            reducer.synchronize()

    params = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in SHAPES]
    reducer = make(params, 0.9, True, {})
    run(reducer, params, range(5))
    saved = reducer.state_dict()
    run(reducer, params, range(5, STEPS))
    again = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in SHAPES]
    resumed = make(again, 0.9, True, {})
    resumed.load_state_dict(saved)
    run(resumed, again, range(5, STEPS))
    plain = GradientReducer([torch.zeros(s, requires_grad=True) for s in SHAPES], "micro", 0.1)
    refused = False
    try:
        plain.load_state_dict(saved)  # saved with momentum correction: not the same setup
    except ValueError:
        refused = True
    return [
        torch.equal(reducer.residual, resumed.residual),
        torch.equal(reducer.velocity, resumed.velocity),
        all(torch.equal(a.grad, b.grad) for a, b in zip(params, again)),
        refused,
    ]


def test_resumes_exactly_with_the_velocity(tmp_path) -> None:
    for result in run_ranks(resume_worker, 2, tmp_path):
        assert result == [True, True, True, True]


def failed_step_worker(rank: int, n: int, nonfinite: str) -> list[bool]:
    gradients = gradients_for(n, 3)
    params = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in SHAPES]
    reducer = make(params, 0.9, False, {}, nonfinite=nonfinite)
    for t in range(3):
        set_gradients(params, gradients[t][rank])
        reducer.synchronize()
    before = (reducer.residual.clone(), reducer.velocity.clone())
    poisoned = gradients[3][rank].copy()
    if rank == 1:
        poisoned[5] = math.nan
    set_gradients(params, poisoned)
    try:
        failed = reducer.synchronize().skipped
    except NonFiniteGradientError:
        failed = True
    return [failed, torch.equal(before[0], reducer.residual),
            torch.equal(before[1], reducer.velocity)]  # fmt: skip


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_a_failed_step_leaves_the_velocity_untouched(nonfinite: str, tmp_path) -> None:
    for result in run_ranks(failed_step_worker, 2, tmp_path, nonfinite):
        assert result == [True, True, True]


def test_bad_momentum_correction_names_the_option() -> None:
    params = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ValueError, match="momentum_correction must be in"):
        GradientReducer(params, "micro", 0.5, momentum_correction=1.0)
    with pytest.raises(TypeError, match="momentum_correction must be a number"):
        GradientReducer(params, "micro", 0.5, momentum_correction=True)
    with pytest.raises(ValueError, match="momentum_correction needs error feedback"):
        GradientReducer(params, "dense", 1.0, momentum_correction=0.9)
    with pytest.raises(ConfigError, match="momentum_correction"):
        TrainConfig(momentum_correction=True, optimizer="adam").resolved()
    with pytest.raises(ConfigError, match="momentum_correction"):
        TrainConfig(momentum_correction=True, sparsifier="dense").resolved()
