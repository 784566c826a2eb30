"""MiCRO's values as 8-bit integers (``value_dtype=torch.int8`` on the compact wire).

Every rank sends round(a / s) at the step's positions, clipped to ±levels (127 // n, so that
the all-reduce's sum of n ranks fits 8 bits), on one scale s that every rank learns in the
index message: the largest |a| any rank has at its own positions, over levels. What rounding
and clipping take stays in the sender's residual. Checked on real gloo ranks, against the
arithmetic that defines it, in both of the step's paths (the flat gradient of a DDP bucket,
selected before the residual is written, and the loop API's per-parameter list).
"""

from __future__ import annotations

import json

import pytest
import torch

import microsparse.ddp
from distributed import run_ranks
from microsparse import GradientReducer, SparseOptions
from microsparse.comm import ProcessGroupCollectives
from microsparse.engine import FlatOutput, SparseStep, run_blocking
from microsparse.feedback import ErrorFeedback
from microsparse.layout import Layout
from microsparse.sparsifiers import create_sparsifier
from microsparse_lab.bench.accuracy import AccuracyConfig, train_arguments
from microsparse_lab.methods.names import parse_method
from test_cli import records_by_value_dtype

NUMEL, STEPS, INF_STEP = 30_000, 5, 3


class Recording(ProcessGroupCollectives):
    """The process group's collectives, with each request's purpose and dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, torch.dtype]] = []

    def run(self, request):  # type: ignore[no-untyped-def]
        self.calls.append((request.what, request.tensor.dtype))
        return super().run(request)


def int8_worker(rank: int, n: int, scale: float | None) -> dict[str, list]:
    """Five steps of one slab on int8 values, its gradient handed over flat and as a list;
    an Inf on rank 0 at step 3; with ``scale``, scaled as a ``GradScaler`` scales it."""
    layout = Layout.of([("w", torch.zeros(NUMEL))])
    got: dict[str, list] = {}
    for how in ("flat", "list"):
        sparsifier = create_sparsifier("micro", 0.01)
        sparsifier.bind(layout, rank, n)
        feedback = ErrorFeedback(layout, torch.float32, torch.device("cpu"))
        engine, comm = SparseStep(sparsifier, feedback, value_dtype=torch.int8), Recording()
        got[how] = []
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(10 * step + rank)
            gradient = torch.randn(NUMEL, generator=generator) * (1 + 9 * rank)  # unequal
            if step == INF_STEP and rank == 0:
                gradient[7] = torch.inf
            before = feedback.residual.clone()
            factor = None if scale is None else torch.tensor([scale])
            fresh = gradient.clone() if factor is None else gradient * factor
            output = FlatOutput(torch.empty(NUMEL))
            comm.calls.clear()
            report = run_blocking(engine.run(step, fresh if how == "flat" else [fresh], output,
                                             scale=factor), comm)  # fmt: skip
            skipped = report.skipped
            skipped = skipped if isinstance(skipped, bool) else bool(skipped.get())
            got[how].append({"had": before + gradient, "before": before, "skipped": skipped,
                             "after": feedback.residual.clone(), "average": output.data.clone(),
                             "calls": list(comm.calls), "levels": engine.levels})  # fmt: skip
    return got


@pytest.mark.parametrize("scale", [None, 2.0**12], ids=["unscaled", "grad-scaler"])
def test_int8_values_share_one_scale_keep_the_rounding_and_conserve(scale, tmp_path) -> None:
    n = 3
    ranks = run_ranks(int8_worker, n, tmp_path, scale)
    levels = 127 // n
    for how in ("flat", "list"):
        for step in range(STEPS):
            seen = [rank[how][step] for rank in ranks]
            assert seen[0]["levels"] == levels
            assert ("values", torch.int8) in seen[0]["calls"], seen[0]["calls"]
            if step == INF_STEP:  # skipped on every rank: nothing kept changed, NaN written
                for got in seen:
                    assert got["skipped"] and torch.equal(got["after"], got["before"])
                    assert bool(got["average"].isnan().any())
                continue
            average = seen[0]["average"]
            assert all(torch.equal(got["average"], average) for got in seen)
            sent = [(got["had"] - got["after"]).double() for got in seen]
            # The scale: the largest |a| a rank has at its own positions maps to ±levels.
            shared = max(float(s.abs().max()) for s in sent) / levels
            integers = [s / shared for s in sent]
            for q in integers:
                assert float((q - q.round()).abs().max()) < 1e-3, (how, step)
                assert float(q.abs().max()) <= levels + 1e-3
            # The average is the integers' sum on that scale, over n (written scaled, the
            # residual kept unscaled, under a GradScaler).
            unscaled = average.double() / (1.0 if scale is None else scale)
            summed = sum(q.round() for q in integers)
            assert torch.allclose(unscaled * n / shared, summed, atol=1e-3), (how, step)
            # Error feedback conserves: n · average + Σ kept = Σ (residual + gradient).
            had = sum(got["had"].double() for got in seen)
            kept = sum(got["after"].double() for got in seen)
            torch.testing.assert_close(n * unscaled + kept, had, rtol=0, atol=1e-4)
            # Rounding leaves at most half a level, except where a value was clipped.
            for got, q in zip(seen, integers):
                rounded = q.round().abs() < levels
                assert float(got["after"][rounded & (q != 0)].abs().max()) <= shared / 2 * 1.001
    if scale is None:  # the same selection and arithmetic in both paths
        for rank in ranks:
            for flat, listed in zip(rank["flat"], rank["list"]):
                assert torch.equal(flat["after"], listed["after"])
                if not flat["skipped"]:
                    assert torch.equal(flat["average"], listed["average"])


@pytest.mark.parametrize(
    ("numel", "world_size", "density"),
    [(600_000, 2, 0.001), (30_000, 3, 0.01), (8, 4, 0.9)],
    ids=["by-blocks", "direct", "whole-partition"],
)
def test_the_scale_selection_found_is_the_largest_sent_bit_for_bit(
    numel: int, world_size: int, density: float
) -> None:
    """An int8 step's scale comes from the magnitudes MiCRO's search kept (one reduction),
    not from reading |e + g| again at its positions: both must agree to the last bit, in every
    way the search can run, with and without a GradScaler's divisor."""
    layout = Layout.of([("w", torch.zeros(numel))])
    generator = torch.Generator().manual_seed(numel)
    residual = torch.randn(numel, generator=generator)
    gradient = torch.randn(numel, generator=generator) * 1e3
    for rank in range(world_size):
        for step, divisor in ((0, None), (1, torch.tensor([2.0**12 + 3]))):
            micro = create_sparsifier("micro", density)
            micro.bind(layout, rank, world_size)
            positions = micro.select(residual, step, addend=gradient, divisor=divisor)
            values = residual.index_select(0, positions)
            more = gradient.index_select(0, positions)
            exact = values.add(more) if divisor is None else values.addcdiv(more, divisor)
            found = micro.largest_sent(positions)
            assert found is not None and found.shape == (1,)
            assert torch.equal(found, exact.abs().amax().view(1)), (rank, step)
            assert micro.largest_sent(positions.clone()) is None  # other positions: not known
    assert create_sparsifier("topk", 0.01).largest_sent(torch.arange(3)) is None


def test_int8_is_refused_where_it_cannot_work() -> None:
    layout = Layout.of([("w", torch.zeros(1000))])
    feedback = ErrorFeedback(layout, torch.float32, torch.device("cpu"))
    for name, options in (("topk", {}), ("micro", {"wire": "plain"})):
        sparsifier = create_sparsifier(name, 0.01, **options)
        sparsifier.bind(layout, 0, 2)
        with pytest.raises(ValueError, match="value_dtype=torch.int8 needs an index message"):
            SparseStep(sparsifier, feedback, value_dtype=torch.int8)
        with pytest.raises(ValueError, match=f"which '{name}' on its (padded|fixed) wire"):
            SparseOptions(name, 0.01, value_dtype=torch.int8, options=options)
    with pytest.raises(ValueError, match="on its fixed wire"):  # as the engine would
        SparseOptions("micro", 1.0, value_dtype=torch.int8, options={"wire": "plain"})
    SparseOptions("dense", 0.5, value_dtype=torch.int8)  # a dense average sends its own dtype
    micro = create_sparsifier("micro", 0.01)
    micro.bind(layout, 0, 128)
    with pytest.raises(ValueError, match="value_dtype=torch.bfloat16 beyond 127 ranks"):
        SparseStep(micro, feedback, value_dtype=torch.int8)
    with pytest.raises(ValueError, match="value_dtype=torch.int8 needs an index message"):
        GradientReducer([torch.zeros(10, requires_grad=True)], "topk", 0.1,
                        value_dtype=torch.int8)  # fmt: skip


def test_a_budget_buys_half_again_the_entries_on_int8_values() -> None:
    """2.26 bytes an entry against 3.26 (10.1 bits an offset at either density, l = 8)."""
    bfloat16 = SparseOptions("micro", budget=0.002, value_dtype=torch.bfloat16)
    int8 = SparseOptions("micro", budget=0.002, value_dtype=torch.int8)
    assert 1.45 < int8.density / bfloat16.density < 1.48
    assert SparseOptions("micro", budget=0.002).density == int8.density  # the default here
    assert SparseOptions.from_dict(int8.to_dict()) == int8


def test_train_sends_int8_values_for_fewer_bytes(tmp_path) -> None:
    records = records_by_value_dtype(tmp_path, ("bfloat16", "int8"))
    for wide, narrow in zip(records["bfloat16"], records["int8"]):
        assert wide["selected"] == narrow["selected"] > 0  # quotas: k every step
        assert narrow["bytes_sent"] < wide["bytes_sent"]
    summary = json.loads((tmp_path / "int8" / "summary.json").read_text())
    assert summary["config"]["value_dtype"] == "int8"


def test_a_method_name_carries_its_value_dtype_to_every_integration() -> None:
    method = parse_method("micro(value_dtype=int8,budget=0.002)@ddp")
    assert (method.kind, method.options, method.budget) == ("hook", {}, 0.002)
    assert method.value_options() == {"value_dtype": torch.int8}
    assert parse_method("micro").value_options() == {}
    arguments = train_arguments(method.name, AccuracyConfig(methods=("dense", method.name)))
    assert arguments[arguments.index("--value-dtype") + 1] == "int8"
    assert arguments[arguments.index("--integration") + 1] == "ddp"
    assert arguments[arguments.index("--budget") + 1] == "0.002"
    with pytest.raises(ValueError, match="value_dtype must be one of float16, bfloat16, int8"):
        parse_method("micro(value_dtype=int4)@ddp")
    with pytest.raises(ValueError, match="'topk\\(value_dtype=int8\\)@ddp': .* padded wire"):
        parse_method("topk(value_dtype=int8)@ddp")  # refused before any worker starts


def test_a_state_records_the_values_it_sends_and_refuses_an_older_defaults() -> None:
    """A checkpoint names the dtype the values travelled in, not the option (None: the
    wire's choice), so that a state saved when the default was another (bfloat16, before
    int8) is refused by name instead of continuing with other values."""
    reducer = GradientReducer([torch.zeros(100, requires_grad=True)], "micro", 0.1)
    state = reducer.state_dict()
    assert "|torch.int8|" in state["fingerprint"]
    older = {**state, "fingerprint": state["fingerprint"].replace("|torch.int8|", "|None|")}
    with pytest.raises(ValueError, match="different layout, sparsifier, density or options"):
        reducer.load_state_dict(older)
    plain = GradientReducer([torch.zeros(100, requires_grad=True)], "micro", 0.1, wire="plain")
    assert "|None|" in plain.state_dict()["fingerprint"]  # float32, as before

    hook = microsparse.ddp.SparseState("micro", 0.1)
    saved = hook.state_dict()
    assert saved["config"]["value_dtype"] == "torch.int8"
    with pytest.raises(ValueError, match="saved with options"):
        microsparse.ddp.SparseState("micro", 0.1).load_state_dict(
            {**saved, "config": {**saved["config"], "value_dtype": "None"}}
        )
    # Before init_process_group a state of 32 ranks (bfloat16 there) is taken at its own
    # world size, which the hook checks when it binds.
    wide = {**saved, "rank": 3, "world_size": 32,
            "config": {**saved["config"], "value_dtype": "torch.bfloat16"}}  # fmt: skip
    loaded = microsparse.ddp.SparseState("micro", 0.1)
    loaded.load_state_dict(wide)
    assert loaded.state_dict()["config"]["value_dtype"] == "torch.bfloat16"
