"""SparseOptions: the options every integration takes, checked in one place."""

from __future__ import annotations

import json

import pytest
import torch

import microsparse
from microsparse import GradientReducer, SparseOptions
from microsparse.ddp import SparseState
from microsparse.sparsifiers.warmup import DensityWarmup

EXAMPLES = [
    SparseOptions(),
    SparseOptions("topk", 0.01, value_dtype=torch.bfloat16, nonfinite="raise"),
    SparseOptions("micro", 0.002, momentum_correction=0.9, momentum_nesterov=True,
                  density_warmup=(0.02, 30), options={"selection": "quota"}),  # fmt: skip
    SparseOptions("micro", 0.001, adam_correction=(0.9, 0.999, 1e-8)),
    SparseOptions("dense", 1.0),
]


@pytest.mark.parametrize("options", EXAMPLES, ids=lambda o: o.sparsifier)
def test_a_dict_round_trip_through_json_gives_the_same_options(options: SparseOptions) -> None:
    again = SparseOptions.from_dict(json.loads(json.dumps(options.to_dict())))
    assert again == options
    assert again.fingerprint() == options.fingerprint()


def test_the_fingerprint_tells_every_option_apart() -> None:
    prints = {options.fingerprint() for options in EXAMPLES}
    assert len(prints) == len(EXAMPLES)
    base = SparseOptions("micro", 0.001)
    for changed in (
        SparseOptions("micro", 0.002),
        SparseOptions("micro", 0.001, value_dtype=torch.float16),
        SparseOptions("micro", 0.001, momentum_correction=0.9),
        SparseOptions("micro", 0.001, momentum_correction=0.9, momentum_nesterov=True),
        SparseOptions("micro", 0.001, options={"selection": "quota"}),
    ):
        assert changed.fingerprint() != base.fingerprint(), changed


def test_values_are_normalised() -> None:
    options = SparseOptions("micro", 1, momentum_correction=0)
    assert options.density == 1.0 and isinstance(options.density, float)
    assert options.momentum == (0.0, False) and isinstance(options.momentum[0], float)
    warm = SparseOptions("micro", 0.001, density_warmup=(0.01, 5))
    assert warm.density_warmup == DensityWarmup(0.01, 5)
    assert SparseOptions(adam_correction=[0.9, 0.99, 1e-8]).adam_correction == (0.9, 0.99, 1e-8)


@pytest.mark.parametrize("options", EXAMPLES, ids=lambda o: o.sparsifier)
def test_every_integration_builds_the_same_options_from_kwargs(options: SparseOptions) -> None:
    model = torch.nn.Linear(50, 4)
    reducer = GradientReducer(model.parameters(), **options.kwargs())
    assert reducer.sparse_options == options
    assert SparseState(**options.kwargs()).sparse_options == options


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"density": 0}, r"density must be in \(0, 1\]"),
        ({"sparsifier": "mciro"}, "sparsifier must be one of"),
        ({"value_dtype": torch.float64}, "value_dtype must be None"),
        ({"nonfinite": "ignore"}, "nonfinite must be 'skip' or 'raise'"),
        ({"momentum_correction": 1.5}, r"momentum_correction must be in \[0, 1\)"),
        ({"adam_correction": (0.9, 0.99)}, r"adam_correction must be \(beta1, beta2, eps\)"),
        ({"adam_correction": (0.9, 0.99, 1e-8), "momentum_correction": 0.9},
         "use it without momentum_correction"),  # fmt: skip
        ({"density": 1.0, "momentum_correction": 0.9}, "leave momentum_correction at 0"),
        ({"sparsifier": "dense", "adam_correction": (0.9, 0.99, 1e-8)},
         "leave adam_correction unset"),  # fmt: skip
        ({"density": 1.0, "density_warmup": (0.5, 10)}, "leave density_warmup unset"),
        ({"density_warmup": (0.0001, 10)}, "density_warmup"),
        ({"options": {"selection": "nope"}}, "selection"),
    ],
)
def test_bad_options_are_refused_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        SparseOptions(**kwargs)


def test_a_misspelt_keyword_is_named_with_its_closest_spelling_in_each_integration() -> None:
    with pytest.raises(TypeError, match="did you mean 'value_dtype'"):
        GradientReducer(torch.nn.Linear(5, 2).parameters(), "micro", 0.1, value_dtyp=None)
    with pytest.raises(TypeError, match="did you mean 'value_dtype'"):
        SparseState("micro", 0.1, value_dtyp=None)


def test_adam_correction_refuses_a_grad_scaler() -> None:
    options = SparseOptions(adam_correction=(0.9, 0.999, 1e-8))
    with pytest.raises(ValueError, match="grad_scaler"):
        options.check_scaler(object())
    with pytest.raises(ValueError, match="grad_scaler"):
        SparseState(**options.kwargs(), grad_scaler=object())
    options.check_scaler(None)


def test_the_options_are_public() -> None:
    assert microsparse.SparseOptions is SparseOptions
    with pytest.raises(AttributeError):
        SparseOptions().density = 0.5  # type: ignore[misc]
