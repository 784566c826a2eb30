"""A byte budget: the fraction of dense's bytes to send, turned into a density per wire."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from distributed import run_ranks
from microsparse import GradientReducer, SparseOptions
from microsparse.comm.eliasfano import position_bits
from microsparse.ddp import SparseState, sparse_hook
from microsparse.layout import Layout
from microsparse.sparsifiers import available_sparsifiers, create_sparsifier
from microsparse_lab.bench.accuracy import AccuracyConfig, train_arguments
from microsparse_lab.bench.costmodel import FRAMINGS
from microsparse_lab.cli import main
from microsparse_lab.methods.names import parse_method
from microsparse_lab.training.config import ConfigError, TrainConfig

BUDGET = 0.002
NUMEL = 1 << 20
TOLERANCE = 0.02
"""How far the measured share of dense's bytes may stray from the budget at d = 2**20: what
the nominal bytes per entry leave out (the guard, a fixed message's header, the last slot of
padding, a compact message's rounding to whole words) is under 100 bytes a step here, 1.2 %
of 8,389."""

DEFAULT_DENSITY = (0.008 - 2**-8 / 8) / (1 + 9 / 8)
"""What 0.2 % of dense's bytes buy on the compact wire with int8 values: density · (1 byte +
an offset's l + 1 + 2**-l / density bits) = 0.008, with l = 8 low bits (0.0035349)."""
SEVENTEEN_RANKS = (0.008 - 2**-8 / 8) / (2 + 9 / 8)
"""The same with bfloat16 values, beyond 16 ranks (0.0024038, l = 8 too)."""

# (MiCRO's options, value_dtype, bytes of a value, whether positions are compact offsets)
WIRES = [
    ({"wire": "plain"}, None, 4, False),  # int32 index, float32 value
    ({"wire": "plain"}, torch.bfloat16, 2, False),
    ({"wire": "plain"}, torch.float16, 2, False),
    ({"index_message": "padded"}, None, 4, False),  # the plain wire, MiCRO's default for it
    ({}, None, 1, True),  # MiCRO's default, the compact wire: int8 values (≤ 16 ranks)
    ({"wire": "compact"}, torch.bfloat16, 2, True),
    ({"wire": "compact"}, torch.float16, 2, True),
    ({"wire": "compact_positions"}, None, 4, True),  # float32 values
    ({"wire": "compact_positions"}, torch.bfloat16, 2, True),
]


def entry_bytes(case: tuple, density: float) -> float:
    """An entry's bytes at ``density``: its value, and an int32 index or a compact offset."""
    _, _, value, compact = case
    return value + (position_bits(density) / 8 if compact else 4)


def wire_id(case: tuple) -> str:
    options, dtype, *_ = case
    return "-".join([*(str(v) for v in options.values()), str(dtype).replace("torch.", "")])


@pytest.mark.parametrize("case", WIRES, ids=wire_id)
def test_the_density_is_the_one_whose_entries_cost_the_budget(case: tuple) -> None:
    options, dtype, *_ = case
    chosen = SparseOptions("micro", budget=BUDGET, value_dtype=dtype, options=options)
    assert chosen.budget == BUDGET
    density = chosen.density
    assert density * entry_bytes(case, density) == pytest.approx(BUDGET * 4, rel=1e-12)
    assert create_sparsifier("micro", 0.01, **options).entry_bytes(dtype) == entry_bytes(case, 0.01)
    assert create_sparsifier("micro", density, **options).entry_bytes(dtype) == pytest.approx(
        BUDGET * 4 / density, rel=1e-12
    )


def test_a_compact_offset_costs_fewer_bits_the_more_are_sent() -> None:
    """The price of an offset is continuous where its low bits change (at powers of two), so
    a larger budget always buys a larger density."""
    for edge in (2**-8, 2**-12):
        below, above = position_bits(edge * (1 - 1e-9)), position_bits(edge * (1 + 1e-9))
        assert below == pytest.approx(above, abs=1e-6)
    budgets = [BUDGET * 1.1**i for i in range(-60, 40)]
    densities = [SparseOptions("micro", budget=b).density for b in budgets]
    assert all(a < b for a, b in zip(densities, densities[1:]))
    bits = [position_bits(d) for d in densities]
    assert all(a >= b for a, b in zip(bits, bits[1:]))


def test_given_neither_the_default_budget_buys_the_density() -> None:
    # 0.2 % of dense's bytes: 0.0035 of the entries on MiCRO's compact wire (int8 values up
    # to 16 ranks), 0.001 on the plain
    assert SparseOptions().density == pytest.approx(DEFAULT_DENSITY, rel=1e-12)
    assert SparseOptions().budget is None
    assert SparseOptions("micro", options={"wire": "plain"}).density == 0.001
    assert SparseOptions("topk").density == SparseOptions("cltk").density == 0.001
    assert SparseOptions("micro", 0.01).density == 0.01
    reducer = GradientReducer(torch.nn.Linear(50, 4).parameters())
    assert reducer.sparsifier.density == SparseOptions().density


def test_beyond_16_ranks_a_budget_buys_bfloat16_values_at_their_price() -> None:
    """8-bit sums leave each of n ranks 127 // n levels: beyond 16 ranks MiCRO's compact wire
    sends bfloat16 values, and a budget (or the default one) buys the density of 4 bytes an
    entry there, so that the bytes stay the budget's; a density given stays as given."""
    for budget in (None, BUDGET):
        options = SparseOptions("micro", budget=budget)
        assert options.for_ranks(16) is options
        assert options.density == pytest.approx(DEFAULT_DENSITY, rel=1e-12)
        wide = options.for_ranks(17)
        assert wide.density == pytest.approx(SEVENTEEN_RANKS, rel=1e-12)
        assert wide.budget == budget and wide.value_dtype is None
        assert wide.for_ranks(8) == options and wide.for_ranks(64) is wide  # priced anew
    given = SparseOptions("micro", 0.001)
    assert given.for_ranks(64) is given
    named = SparseOptions("micro", budget=BUDGET, value_dtype=torch.bfloat16)
    assert named.for_ranks(64) is named and named.density == wide.density
    layout = Layout.of([("w", torch.zeros(10_000))])
    for world_size, values in ((16, torch.int8), (17, torch.bfloat16)):
        micro = create_sparsifier("micro", 0.01)
        micro.bind(layout, rank=0, world_size=world_size)
        assert micro.framing().value_dtype == values
        value = 1 if values == torch.int8 else 2
        assert micro.entry_bytes(world_size=world_size) == value + position_bits(0.01) / 8
        assert micro.wire_values(world_size) == options.wire_value_dtype(world_size) == values
    assert SparseOptions("micro", options={"wire": "plain"}).wire_value_dtype(4) is None
    assert SparseOptions("micro", 1.0).wire_value_dtype(4) is None  # dense averaging
    config = TrainConfig()
    assert config.resolved(17).density == wide.density
    assert config.resolved(16).density == options.density
    assert TrainConfig(integration="fsdp", shards=2).resolved(34 // 2).density == wide.density
    # a run's config names what the wire chose, where the ranks are known
    assert [config.resolved(n).value_dtype for n in (None, 16, 17)] == [None, "int8", "bfloat16"]
    assert TrainConfig(wire="plain").resolved(4).value_dtype is None
    assert TrainConfig(integration="ddp", ddp_hook="fp16").resolved(4).value_dtype is None


@pytest.mark.parametrize("name", [n for n in available_sparsifiers() if n != "micro"])
def test_each_sparsifier_prices_the_framing_it_sends(name: str) -> None:
    sparsifier = create_sparsifier(name, 0.01)
    sparsifier.bind(Layout.of([("w", torch.zeros(10_000))]), rank=0, world_size=2)
    framing = type(sparsifier.framing())
    assert framing is sparsifier.framing_class
    assert sparsifier.entry_bytes() == framing.position_bytes + 4


@pytest.mark.parametrize("case", WIRES, ids=wire_id)
def test_micro_prices_the_framing_its_wire_chooses(case: tuple) -> None:
    options, dtype, *_ = case
    micro = create_sparsifier("micro", 0.01, **options)
    micro.bind(Layout.of([("w", torch.zeros(10_000))]), rank=0, world_size=2)
    framing = micro.framing()
    values = dtype if dtype is not None else framing.value_dtype
    assert type(framing).entry_bytes(values, 0.01) == entry_bytes(case, 0.01)
    assert FRAMINGS[framing.label] is type(framing)


def _budget_steps(rank: int, world_size: int, cases: list[tuple]) -> list[dict]:
    torch.manual_seed(rank)
    measured = []
    for options, dtype, *_ in cases:
        weight = torch.nn.Parameter(torch.zeros(NUMEL))
        reducer = GradientReducer([weight], "micro", budget=BUDGET, value_dtype=dtype, **options)
        for _ in range(3):
            weight.grad = torch.randn(NUMEL)
            stats = reducer.synchronize()
        measured.append({
            "density": reducer.sparse_options.density, "selected": stats.selected,
            "target": stats.target, "payload_bytes": stats.payload_bytes,
            "budget_used": stats.budget_used, "bytes_sent": stats.bytes_sent,
        })  # fmt: skip
    return measured


def test_the_bytes_each_step_sends_are_the_budget_on_every_wire(tmp_path) -> None:
    ranks = run_ranks(_budget_steps, 2, tmp_path, WIRES)
    assert ranks[0] == ranks[1]  # global numbers, identical on every rank
    for wire, step in zip(WIRES, ranks[0]):
        case = wire_id(wire)
        # the entries: k of the density the budget bought, all sent (quotas)
        assert step["target"] == math.floor(step["density"] * NUMEL), case
        entry = entry_bytes(wire, step["density"])
        assert step["density"] * entry == pytest.approx(BUDGET * 4, rel=1e-12), case
        assert step["selected"] == step["target"], case
        # the bytes: k entries at the nominal price, and a little for headers
        assert step["payload_bytes"] >= step["selected"] * entry, case
        assert step["budget_used"] == step["payload_bytes"] / (4 * NUMEL)
        assert step["budget_used"] == pytest.approx(BUDGET, rel=TOLERANCE), case
        assert 0 < step["bytes_sent"] < step["payload_bytes"], case  # a ring sends a share
    plain, compact, int8 = ranks[0][0], ranks[0][5], ranks[0][4]
    # the compact wire buys 2.4 times the entries of the plain one for the same bytes (10.1
    # bits an offset and bfloat16 values: 3.3 bytes), with 8-bit values (its default on these 2
    # ranks, 2.26 bytes) 3.5 times
    assert 2.4 < compact["selected"] / plain["selected"] < 2.5
    assert int8["selected"] == math.floor(DEFAULT_DENSITY * NUMEL)
    assert 3.5 < int8["selected"] / plain["selected"] < 3.6


def _wide_world(rank: int, world_size: int) -> dict:
    """One backward pass of each integration, left to the defaults, on ``world_size`` ranks."""
    numel = 40_000
    model = torch.nn.Linear(numel // 8, 8, bias=False)
    state = SparseState()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state, sparse_hook)
    unbound = state.density
    ddp(torch.ones(2, numel // 8)).sum().backward()
    reducer = GradientReducer(torch.nn.Linear(numel // 8, 8, bias=False).parameters())
    for param in reducer._params:
        param.grad = torch.ones_like(param)
    looped = reducer.synchronize()
    return {"unbound": unbound, "bound": state.density, "hook": state.last_step,
            "loop": looped, "levels": reducer._engine.levels}


def test_on_17_ranks_the_default_buys_bfloat16_values_in_every_integration(tmp_path) -> None:
    """The hook binds to its process group at the first backward pass, the loop API when
    built: both price the default budget for 17 ranks, beyond int8's 16 (bfloat16 values,
    δ = 0.0024), where a state not yet bound shows the density of a small world."""
    for got in run_ranks(_wide_world, 17, tmp_path):
        assert got["unbound"] == pytest.approx(DEFAULT_DENSITY, rel=1e-12)
        assert got["bound"] == pytest.approx(SEVENTEEN_RANKS, rel=1e-12)
        assert got["levels"] == 0  # no 8-bit values
        for stats in (got["hook"], got["loop"]):
            assert stats.target == math.floor(got["bound"] * 40_000)


def test_density_and_budget_are_exclusive_in_every_integration() -> None:
    with pytest.raises(ValueError, match="give density or budget, not both"):
        SparseOptions("micro", 0.001, budget=BUDGET)
    with pytest.raises(ValueError, match="give density or budget, not both"):
        GradientReducer(torch.nn.Linear(5, 2).parameters(), "micro", 0.01, budget=BUDGET)
    with pytest.raises(ValueError, match="give density or budget, not both"):
        SparseState("micro", 0.01, budget=BUDGET)


@pytest.mark.parametrize(
    ("budget", "error", "message"),
    [
        (0, ValueError, "budget must be > 0"),
        (-0.1, ValueError, "budget must be > 0"),
        (math.nan, ValueError, "budget must be > 0"),
        (math.inf, ValueError, "budget must be > 0"),
        ("0.002", TypeError, "budget must be a number"),
        (True, TypeError, "budget must be a number"),
        (2.5, ValueError, r"budget=2.5 buys more than every entry.*give a budget up to 2\b"),
    ],
)
def test_bad_budgets_are_refused_by_name(budget: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        SparseOptions("micro", budget=budget, options={"wire": "plain"})


def test_a_budget_too_large_for_a_compact_wire_names_its_own_limit() -> None:
    """At density 1 an offset costs 2 bits (no low bits, two high bits an entry)."""
    with pytest.raises(ValueError, match=r"sends 1.25 bytes an entry.*up to 0.3125\b.*density=1"):
        SparseOptions("micro", budget=0.5, options={"wire": "compact"})  # int8 values
    assert SparseOptions("micro", budget=0.3125, options={"wire": "compact"}).averages_densely
    with pytest.raises(ValueError, match=r"sends 2.25 bytes an entry.*up to 0.5625\b.*density=1"):
        SparseOptions("micro", budget=0.6, value_dtype=torch.bfloat16)


def test_the_budget_round_trips_and_tells_its_options_apart() -> None:
    chosen = SparseOptions("micro", budget=BUDGET, value_dtype=torch.bfloat16,
                           momentum_correction=0.9, options={"selection": "quota"})  # fmt: skip
    saved = json.loads(json.dumps(chosen.to_dict()))
    assert saved["budget"] == BUDGET and saved["density"] == chosen.density
    again = SparseOptions.from_dict(saved)
    assert again == chosen and again.fingerprint() == chosen.fingerprint()
    # the same density asked for directly is another option set
    same_density = SparseOptions("micro", chosen.density, value_dtype=torch.bfloat16,
                                 momentum_correction=0.9,
                                 options={"selection": "quota"})  # fmt: skip
    assert same_density.fingerprint() != chosen.fingerprint()
    assert "budget" not in same_density.to_dict()
    # every integration builds the same options from their keywords
    assert "density" not in chosen.kwargs() and chosen.kwargs()["budget"] == BUDGET
    reducer = GradientReducer(torch.nn.Linear(50, 4).parameters(), **chosen.kwargs())
    assert reducer.sparse_options == chosen
    state = SparseState(**chosen.kwargs())
    assert state.sparse_options == chosen and state.density == chosen.density


def test_a_train_config_resolves_its_budget_once_and_refuses_both() -> None:
    config = TrainConfig(budget=BUDGET, value_dtype="bfloat16", wire="plain").resolved()
    assert config.budget == BUDGET and config.density == pytest.approx(BUDGET * 4 / 6)
    assert config.resolved() == config  # a resumed run's config holds both
    assert TrainConfig().resolved().density == SparseOptions().density  # int8 values
    assert TrainConfig(wire="plain").resolved().density == 0.001
    with pytest.raises(ConfigError, match="not both") as raised:
        TrainConfig(density=0.01, budget=BUDGET).resolved()
    assert raised.value.field == "budget"


def test_train_refuses_density_beside_budget(capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["train", "--density", "0.01", "--budget", "0.002", "--out", str(tmp_path / "r")])
    assert raised.value.code == 2
    assert "argument --budget: give --density or --budget, not both" in capsys.readouterr().err


@pytest.mark.parametrize("integration", ["loop", "ddp"])
def test_train_with_a_budget_sends_that_share_of_dense_bytes(integration: str, tmp_path) -> None:
    out = tmp_path / "run"
    budget = 0.04  # the default task's small model: enough entries that headers are small
    result = subprocess.run(
        [sys.executable, "-m", "microsparse_lab", "train", "--workers", "2", "--max-steps",
         "3", "--budget", str(budget), "--integration", integration, "--no-progress",
         "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "summary.json").read_text())["config"]
    density = SparseOptions(budget=budget).density  # int8 values on 2 ranks
    assert config["budget"] == budget and config["density"] == pytest.approx(density)
    assert 0.096 < density < 0.097  # 1 byte a value, 4.3 bits an offset at l = 3
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records:
        assert record["target"] == math.floor(config["density"] * record["numel"])
        assert record["budget_used"] == pytest.approx(budget, rel=0.05)


def test_a_method_name_carries_its_own_budget() -> None:
    method = parse_method("micro(budget=0.002,wire=compact)@ddp")
    assert method.budget == 0.002 and method.options == {"wire": "compact"}
    assert method.amount(0.001) == {"budget": 0.002}
    assert parse_method("micro").amount(0.001, budget=0.004) == {"budget": 0.004}
    assert parse_method("micro(density=0.01)").amount(0.001, budget=0.004) == {"density": 0.01}
    with pytest.raises(ValueError, match="give density or budget, not both"):
        parse_method("micro(density=0.01,budget=0.002)")
    with pytest.raises(ValueError, match="budget must be a number > 0"):
        parse_method("micro(budget=-1)")


def test_bench_accuracy_trains_each_method_at_the_budget() -> None:
    config = AccuracyConfig(rates=("100mbit",), methods=("dense", "micro", "topk"), budget=0.002)
    assert train_arguments("micro", config)[2:4] == ["--budget", "0.002"]
    assert "--density" not in train_arguments("topk", config)
    own = train_arguments("micro(density=0.01)", config)
    assert own[2:4] == ["--density", "0.01"] and "--budget" not in own


def test_bench_accuracy_refuses_density_beside_budget(capsys) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["bench", "accuracy", "--density", "0.01", "--budget", "0.002"])
    assert raised.value.code == 2
    assert "argument --budget: give --density or --budget, not both" in capsys.readouterr().err


def test_a_state_saved_at_another_density_names_the_density_that_continues_it() -> None:
    """A state saved while the default budget bought 16-bit offsets' density (8/3 · 0.001)
    is refused by a reducer left to the defaults, which buy more entries now: the error
    names the option and the value that continues the run."""
    saved = GradientReducer(torch.nn.Linear(50, 4).parameters(), "micro", 0.002 * 4 / 3)
    state = saved.state_dict()
    default = GradientReducer(torch.nn.Linear(50, 4).parameters())
    with pytest.raises(ValueError) as refused:
        default.load_state_dict(state)
    message = str(refused.value)
    assert f"density: saved {0.002 * 4 / 3!r}, here {default.sparsifier.density!r}" in message
    assert f"to continue that run, pass density={0.002 * 4 / 3!r}" in message
    assert "sparsifier options" not in message  # only what differs
    continued = GradientReducer(torch.nn.Linear(50, 4).parameters(), density=0.002 * 4 / 3)
    continued.load_state_dict(state)
    assert continued.step == saved.step
