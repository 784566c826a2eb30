"""Bad input gets a clear error that names the argument; ranks that disagree are told so."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import microsparse
from distributed import run_ranks
from microsparse import ConfigMismatchError, GradientReducer, NonFiniteGradientError
from microsparse.engine import SparseStep
from microsparse.feedback import ErrorFeedback
from microsparse.layout import Layout
from microsparse.options import DEFAULT_BUDGET
from microsparse.sparsifiers.cltk import CyclicLocalTopK


def linear() -> torch.nn.Module:
    return torch.nn.Linear(4, 3)


@pytest.mark.parametrize("density", [0, -0.1, 1.5, math.nan, math.inf])
def test_density_out_of_range(density: float) -> None:
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
        GradientReducer(linear(), "micro", density)


@pytest.mark.parametrize("density", ["0.1", True])
def test_density_not_a_number(density: object) -> None:
    with pytest.raises(TypeError, match="density must be a number"):
        GradientReducer(linear(), "micro", density)  # type: ignore[arg-type]


def test_no_density_means_the_default_budget_not_an_error() -> None:
    # None is "not given": the default budget (0.2 % of dense's bytes) buys the density on the
    # sparsifier's wire, MiCRO's compact one (2.26 bytes an entry with 8-bit values, on up to
    # 16 ranks: 10.1-bit offsets at that density) or the plain one (8)
    assert DEFAULT_BUDGET == 0.002
    default = GradientReducer(linear(), "micro").sparse_options.density
    assert round(default, 6) == 0.003535
    assert GradientReducer(linear(), "micro", None).sparse_options.density == default
    assert GradientReducer(linear(), "topk").sparse_options.density == 0.001
    assert GradientReducer(linear(), "micro", wire="plain").sparse_options.density == 0.001
    larger = GradientReducer(linear(), "micro", budget=0.003).sparse_options.density
    assert round(larger, 6) == 0.005512  # 9-bit offsets there


def test_unknown_sparsifier_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"sparsifier must be one of .*micro.*'nope'"):
        GradientReducer(linear(), "nope", 0.1)


def test_unknown_option_names_the_accepted_ones() -> None:
    expected = r"keyword 'threshold' \(did you mean 'threshold_rule'\?\)\..*takes: selection"
    with pytest.raises(TypeError, match=expected):
        GradientReducer(linear(), "micro", 0.1, threshold=0.5)


@pytest.mark.parametrize(("owner", "keyword", "closest"), [
    (GradientReducer, "value_dtyp", "value_dtype"),
    (GradientReducer, "momentum_corection", "momentum_correction"),
    (microsparse.ddp.MicroState, "one_exchang", "one_exchange"),
    (microsparse.ddp.SparseState, "timout", "timeout"),
])  # fmt: skip
def test_a_misspelt_keyword_is_named_with_the_closest_spelling(owner, keyword, closest) -> None:
    arguments = (linear(), "topk", 0.1) if owner is GradientReducer else ()
    with pytest.raises(TypeError, match=f"'{keyword}' \\(did you mean '{closest}'\\?\\)"):
        owner(*arguments, **{keyword: 1})


def test_transactional_names_what_replaced_it() -> None:
    with pytest.raises(TypeError, match="nonfinite='raise'"):
        GradientReducer(linear(), "micro", 0.1, transactional=True)


def test_the_hook_state_refuses_a_positional_value_dtype_and_a_bad_timeout() -> None:
    with pytest.raises(TypeError, match="process_group .* must be a torch.distributed"):
        microsparse.ddp.SparseState("micro", 0.001, torch.bfloat16)
    with pytest.raises(ValueError, match="timeout must be None or a number of seconds > 0"):
        microsparse.ddp.MicroState(0.001, timeout=-1)


def test_import_microsparse_gives_its_submodules() -> None:
    import subprocess
    import sys

    code = ("import microsparse; print(microsparse.ddp.MicroState.__name__, "
            "microsparse.fsdp.sparsify.__name__)")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "MicroState sparsify", result.stderr
    with pytest.raises(AttributeError, match="no attribute 'dpp'"):
        microsparse.dpp  # noqa: B018


def test_unknown_threshold_rule() -> None:
    expected = r"threshold_rule must be one of quantile, symmetric, as_coded"
    with pytest.raises(ValueError, match=expected):
        GradientReducer(linear(), "micro", 0.1, threshold_rule="fast")


def test_unknown_selection() -> None:
    with pytest.raises(ValueError, match=r"selection must be one of quota, threshold; got 'top'"):
        GradientReducer(linear(), "micro", 0.1, selection="top")


def test_quota_selection_takes_no_step_rule() -> None:
    with pytest.raises(ValueError, match=r"threshold_rule='as_coded' needs selection='threshold'"):
        GradientReducer(linear(), "micro", 0.1, selection="quota", threshold_rule="as_coded")


def test_a_threshold_rule_implies_threshold_selection() -> None:
    options = GradientReducer(linear(), "micro", 0.1, threshold_rule="as_coded").sparsifier
    assert options.options()["selection"] == "threshold"
    assert GradientReducer(linear(), "micro", 0.1).sparsifier.options()["selection"] == "quota"


def test_complex_parameters_are_refused() -> None:
    bad = torch.zeros(3, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(
        TypeError, match=r"params: codes has dtype torch.complex64; only real floating-point"
    ):
        GradientReducer(
            [("weight", torch.zeros(3, requires_grad=True)), ("codes", bad)], "micro", 0.1
        )


def test_frozen_integer_parameters_are_skipped() -> None:
    """An integer tensor cannot require grad: as a frozen parameter it is skipped, like any."""
    codes = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    reducer = GradientReducer(
        [("weight", torch.zeros(4, requires_grad=True)), ("codes", codes)], "micro", 0.5
    )
    assert reducer.layout.names == ("weight",)


def test_no_trainable_parameters() -> None:
    model = linear().requires_grad_(False)
    with pytest.raises(ValueError, match="params: no parameter requires grad"):
        GradientReducer(model, "micro", 0.1)
    with pytest.raises(ValueError, match="params: no parameter requires grad"):
        GradientReducer([], "micro", 0.1)


def test_synchronize_before_backward_says_to_call_backward() -> None:
    model = torch.nn.Linear(4, 2)
    reducer = GradientReducer(model.parameters(), "micro", 0.5)
    with pytest.raises(RuntimeError, match=r"every \.grad is None.*loss\.backward\(\) first"):
        reducer.synchronize()
    assert model.weight.grad is None and reducer.step == 0  # nothing was written


def ddp_warning_worker(rank: int, n: int) -> list[str]:
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GradientReducer(ddp, "micro", 0.5)
        GradientReducer(ddp.module, "micro", 0.5)
    return [str(w.message) for w in caught]


def test_a_ddp_model_is_named_since_it_would_also_average_densely(tmp_path) -> None:
    for messages in run_ranks(ddp_warning_worker, 2, tmp_path):
        assert len(messages) == 1, messages  # the wrapped model only, not its .module
        assert "averages every gradient densely" in messages[0] and "ddp.module" in messages[0]


def test_frozen_and_tied_parameters_are_counted_once() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight  # tied
    reducer = GradientReducer(model, "micro", 0.5)
    assert reducer.layout.numel == 20
    assert reducer.layout.names == ("0.weight",)


def test_nonfinite_gradient_on_one_worker_process() -> None:
    model = linear()
    reducer = GradientReducer(model, "micro", 0.5, nonfinite="raise")
    model(torch.randn(2, 4)).sum().backward()
    model.bias.grad[1] = math.inf
    with pytest.raises(
        NonFiniteGradientError, match=r"step 0: NaN or Inf gradient in bias; this rank's"
    ):
        reducer.synchronize()
    assert reducer.step == 0 and not reducer.residual.any()


def test_a_nonfinite_gradient_skips_the_step_and_keeps_the_residual() -> None:
    model = linear()
    reducer = GradientReducer(model, "micro", 0.5)
    for step in range(3):
        model.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        if step == 2:
            model.weight.grad[0, 1] = math.nan
        before = reducer.residual.clone()
        stats = reducer.synchronize()
    assert stats.skipped and torch.equal(reducer.residual, before)
    written = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert int(written.isnan().sum()) == stats.target  # NaN where the average would be


def nonfinite_worker(rank: int, n: int) -> list[str]:
    """Rank 1's gradient has a NaN at step 2 only: with nonfinite="raise", every rank raises
    in that step, and the next one trains on."""
    model = torch.nn.Linear(4, 3)
    reducer = GradientReducer(model.named_parameters(), "micro", 0.5, nonfinite="raise")
    messages = []
    for step in range(2 + n):
        model.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        if step == 2 and rank == 1:
            model.weight.grad[0, 0] = math.nan
        try:
            reducer.synchronize()
        except NonFiniteGradientError as error:
            messages.append(str(error))
    return messages


def test_nonfinite_gradient_stops_every_rank_in_the_same_step(tmp_path) -> None:
    messages = run_ranks(nonfinite_worker, 2, tmp_path)
    for rank_messages in messages:
        assert len(rank_messages) == 1 and rank_messages[0].startswith("step 2: NaN or Inf")
    assert "gradient in weight; this rank's gradient holds them" in messages[1][0]
    assert "on rank 1; this rank's own gradient was finite" in messages[0][0]


def mismatch_worker(rank: int, n: int, what: str) -> str:
    model = torch.nn.Linear(64, 3 + (rank if what == "shape" else 0))
    density = 0.05 if what != "density" or rank == 0 else 0.025
    # Inside a density warm-up the index message is larger at every step: a rank at another
    # step must still meet the others in a round of the same size.
    warmup = (0.5, 10) if what == "step in a warm-up" else None
    try:
        reducer = GradientReducer(model, "micro", density, density_warmup=warmup)
        if what.startswith("step"):
            model(torch.randn(2, 64)).sum().backward()
            if rank == 1:
                reducer.step = 7 if what == "step" else 3  # resumed from another checkpoint
            reducer.synchronize()
    except ConfigMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("density", r"ranks disagree on the reducer configuration.*: "
                    r"density \(rank 0: 0\.05, rank 1: 0\.025\); every rank must pass"),
        ("shape", r"parameter shapes \(rank 0: 3x64,3, rank 1: 4x64,4\)"),
        (
            "step",
            r"called synchronize\(\) a different number of times \(steps per rank: \[0, 7\]\)",
        ),
        (
            "step in a warm-up",
            r"called synchronize\(\) a different number of times \(steps per rank: \[0, 3\]\)",
        ),
    ],
)
def test_disagreeing_ranks_are_detected_not_deadlocked(what: str, message: str, tmp_path) -> None:
    for text in run_ranks(mismatch_worker, 2, tmp_path, what):
        assert __import__("re").search(message, text), text


def test_public_api_names() -> None:
    assert "micro" in microsparse.available_sparsifiers()
    assert microsparse.__version__


def test_a_sparsifier_that_is_planned_and_agrees_is_refused() -> None:
    """The Sparsifier contract's rule: a step has a leader's plan or an all-ranks sum."""
    class PlannedAndAgreeing(CyclicLocalTopK):
        @property
        def agrees(self) -> bool:
            return True

    layout = Layout.of([("w", torch.empty(100))])
    sparsifier = PlannedAndAgreeing(0.1)
    sparsifier.bind(layout, 0, 2)
    feedback = ErrorFeedback(layout, torch.float32, torch.device("cpu"))
    with pytest.raises(TypeError, match="planned and asks for an agreement"):
        SparseStep(sparsifier, feedback)
    planned = CyclicLocalTopK(0.1)
    planned.bind(layout, 0, 2)
    SparseStep(planned, feedback)  # planned alone is fine
