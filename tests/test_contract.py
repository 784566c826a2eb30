"""The sparsifier contract, for every registered sparsifier, in both drivers, on real gloo ranks.

The cases are drawn from ``available_sparsifiers()`` when the tests are collected: a sparsifier
that is one new file plus its registry line is covered here with no edit; options that change
how a step travels (MiCRO's compact wire) are cases of their own (``VARIANTS``). Each one runs
with its default options (MiCRO's values in float64 on the plain wire, ``PINNED``: its default
compact wire rounds them to bfloat16, held to its own rules in tests/test_compact.py; the
variant ``compact_positions`` sends the same compact positions with float64 values), for a
few steps of a small float64 model, in the loop API
(``GradientReducer.synchronize``) and in the DDP comm hook (``SparseState`` + ``sparse_hook``
over several buckets), and must keep the rules its base class states:

- error feedback loses nothing: on every rank, what was not sent stays in its residual to the
  bit, and over the ranks, what they had equals n times the average plus what they kept;
- every rank ends the step with the same average, bit for bit, and the same global statistics;
- ``select`` returns distinct positions, and the statistics count what was sent;
- ``state_dict`` is a snapshot, and a fresh reducer or hook state loaded from it continues bit
  for bit;
- ``framing`` is pure;
- the hook averaging the whole model as one slab (``one_exchange``) is the loop API.

One launch of the ranks per sparsifier and driver gathers what every rank saw; each test reads
the invariant it names from it.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from microsparse import GradientReducer
from microsparse.comm.framing import Fixed
from microsparse.ddp import SparseState, sparse_hook
from microsparse.layout import Layout
from microsparse.sparsifiers import available_sparsifiers, create_sparsifier

VARIANTS = {"micro(wire=compact_positions)": ("micro", {"wire": "compact_positions"})}
"""Sparsifiers with options that change how a step runs, held to the same contract."""
PINNED = {"micro": {"wire": "plain"}}
"""Registered sparsifiers' options where their defaults round the values sent (the bit-exact
rules below need them unrounded)."""
NAMES = [*available_sparsifiers(), *VARIANTS]
WORLD = 2
DENSITY = 0.01  # k = 15 of d = 1,564 (the hook's slabs: at least 1 each)
STEPS = 6
SAVE_AT = 3  # state saved after steps 0-2, resumed for steps 3-5
BUCKET_MB = 0.002  # DDP rebuilds its single first bucket into three after the first pass
GLOBAL_FIELDS = ("step", "numel", "world_size", "selected", "target", "max_local_selected",
                 "proposed", "exchange", "skipped", "dense_bytes")  # fmt: skip
"""``StepStats`` fields documented as identical on every rank (the others are this rank's:
``local_*``, the partition, the threshold of a per-rank rule, the timings, the bytes sent)."""


def registered(name: str) -> str:
    """A case's sparsifier, as the registry names it."""
    return VARIANTS.get(name, (name, {}))[0]


def options_of(name: str) -> dict[str, Any]:
    """A case's sparsifier options."""
    return VARIANTS.get(name, (name, PINNED.get(name, {})))[1]


def make_model() -> nn.Module:
    """Four layers, d = 1,564, tanh: no gradient entry is exactly 0, so the positions a step
    sent are exactly the zeros of every residual after it."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
        nn.Linear(24, 4),
    ).double()  # fmt: skip


def loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 10, generator=generator, dtype=torch.float64)
    return model(x).pow(2).mean()


def flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


# ---------------------------------------------------------------------------------------------
# Observing a rank from inside: what select returned, and the sparsifier's whole state.


class SelectSpy:
    """Records what the sparsifier class's own ``select`` returns, in this rank's process only
    (a spawned one), and returns it unchanged: an observer of the real method, not a stand-in."""

    def __init__(self, name: str) -> None:
        cls = type(create_sparsifier(registered(name), DENSITY))
        original = cls.select
        self.calls: list[tuple[Any, torch.Tensor]] = []

        @functools.wraps(original)
        def select(sparsifier, accumulated, step, scratch=None, **addend):
            positions = original(sparsifier, accumulated, step, scratch, **addend)
            self.calls.append((sparsifier, positions.clone()))
            return positions

        cls.select = select

    def take(self) -> list[tuple[Any, torch.Tensor]]:
        calls, self.calls = self.calls, []
        return calls


def freeze(value: Any, depth: int = 0) -> Any:
    """A comparable copy of ``value`` and everything it holds (tensors by content, NaN equal
    to NaN, objects by their attributes), to tell whether anything in it changed."""
    if isinstance(value, torch.Tensor):
        entries = value.detach().cpu().reshape(-1).tolist()
        return ("tensor", str(value.dtype), tuple(value.shape), tuple(map(_number, entries)))
    if isinstance(value, torch.Generator):
        return ("generator", freeze(value.get_state()))
    if isinstance(value, float):
        return _number(value)
    if value is None or isinstance(value, (str, int, bool, torch.dtype, torch.device)):
        return value
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), freeze(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(freeze(v, depth + 1) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(map(repr, value))))
    if hasattr(value, "__dict__") and depth < 8:
        return (type(value).__qualname__, freeze(vars(value), depth + 1))
    return repr(value)


def _number(value: Any) -> Any:
    return "nan" if isinstance(value, float) and math.isnan(value) else value


def describe(framing: Any) -> tuple:
    """A framing as the step reads it: its class, its label and its public settings."""
    settings = {key: value for key, value in vars(framing).items()
                if not key.startswith("_") and not isinstance(value, torch.Tensor)}  # fmt: skip
    return (type(framing).__qualname__, framing.label, sorted(settings.items()))


def framing_problems(sparsifier: Any) -> list[str]:
    """The purity rule: two calls describe the same framing and change nothing."""
    before = {key: freeze(value) for key, value in vars(sparsifier).items()}
    first, second = sparsifier.framing(), sparsifier.framing()
    problems = []
    if describe(first) != describe(second):
        problems.append(f"framing() gave {describe(first)}, then {describe(second)}")
    after = {key: freeze(value) for key, value in vars(sparsifier).items()}
    if after != before:
        changed = sorted(key for key in {*before, *after} if before.get(key) != after.get(key))
        problems.append(f"framing() changed the sparsifier's {', '.join(changed)}")
    return problems


def proposals(calls: list[tuple[Any, torch.Tensor]]) -> list[dict]:
    """What a rank's sparsifiers selected in one step, one entry per slab."""
    out = []
    for sparsifier, positions in calls:
        framing = sparsifier.framing()
        capacity = framing.capacity if isinstance(framing, Fixed) else None
        out.append({"slab": id(sparsifier), "numel": sparsifier.layout.numel,
                    "positions": positions, "capacity": capacity,
                    "framing": framing_problems(sparsifier)})  # fmt: skip
    return out


def snapshot_problems(sparsifier: Any, live: dict, taken: Any, name: str) -> list[str]:
    """A state_dict saved steps ago must still be what it was (a snapshot, not live tensors),
    and a fresh sparsifier loaded from it must give it back."""
    problems = []
    if freeze(live) != taken:
        problems.append("state_dict() changed after later steps: it holds live state")
    fresh = create_sparsifier(sparsifier.name, DENSITY, **options_of(name))
    fresh.bind(sparsifier.layout, sparsifier.rank, sparsifier.world_size, sparsifier.target)
    fresh.load_state_dict(copy.deepcopy(live))
    if freeze(fresh.state_dict()) != taken:
        problems.append("a fresh sparsifier loaded from state_dict() saves another state")
    return problems


# ---------------------------------------------------------------------------------------------
# The two drivers, as every rank runs them.


def loop_worker(rank: int, n: int, name: str) -> dict:
    spy = SelectSpy(name)
    model = make_model()
    params = list(model.parameters())
    reducer = GradientReducer(params, registered(name), DENSITY, **options_of(name))
    optimizer = torch.optim.SGD(params, lr=0.1)
    steps, saved, purity = [], None, framing_problems(reducer.sparsifier)
    for step in range(STEPS):
        if step == SAVE_AT:
            live = reducer.sparsifier.state_dict()
            saved = (copy.deepcopy(reducer.state_dict()), copy.deepcopy(model.state_dict()),
                     live, freeze(live))  # fmt: skip
        before = reducer.residual.clone()
        optimizer.zero_grad()
        loss(model, step, rank).backward()
        fresh = flat(p.grad for p in params)
        stats = reducer.synchronize()
        steps.append({"fresh": fresh, "before": before, "average": flat(p.grad for p in params),
                      "after": reducer.residual.clone(), "stats": stats,
                      "proposals": proposals(spy.take())})  # fmt: skip
        optimizer.step()
    state, weights, live, taken = saved
    resumed = resume_loop(rank, name, state, weights)
    return {"steps": steps, "resumed": resumed, "framing": purity,
            "snapshot": snapshot_problems(reducer.sparsifier, live, taken, name)}  # fmt: skip


def resume_loop(rank: int, name: str, state: dict, weights: dict) -> list[dict]:
    model = make_model()
    model.load_state_dict(weights)
    params = list(model.parameters())
    reducer = GradientReducer(params, registered(name), DENSITY, **options_of(name))
    reducer.load_state_dict(state)
    optimizer = torch.optim.SGD(params, lr=0.1)
    out = []
    for step in range(SAVE_AT, STEPS):
        optimizer.zero_grad()
        loss(model, step, rank).backward()
        stats = reducer.synchronize()
        out.append({"average": flat(p.grad for p in params), "after": reducer.residual.clone(),
                    "stats": stats})  # fmt: skip
        optimizer.step()
    return out


def ddp_worker(rank: int, n: int, name: str) -> dict:
    spy = SelectSpy(name)
    model = make_model()
    replica = copy.deepcopy(model)  # the same model outside DDP: this rank's own gradient
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    state = SparseState(registered(name), DENSITY, **options_of(name))
    ddp.register_comm_hook(state, sparse_hook)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    numel = sum(p.numel() for p in params)
    steps, saved, previous = [], None, torch.zeros(numel, dtype=torch.float64)
    for step in range(STEPS):
        if step == SAVE_AT:
            live = state.state_dict()
            saved = (copy.deepcopy(live), copy.deepcopy(model.state_dict()), live, freeze(live))
        replica.load_state_dict(model.state_dict())
        fresh = flat(torch.autograd.grad(loss(replica, step, rank), list(replica.parameters())))
        optimizer.zero_grad()
        loss(ddp, step, rank).backward()
        after = flat(state.residual(p) for p in params)
        steps.append({"fresh": fresh, "before": previous, "average": flat(p.grad for p in params),
                      "after": after, "stats": state.last_step,
                      "proposals": proposals(spy.take())})  # fmt: skip
        previous = after
        optimizer.step()
    slabs = state.last_step.extra["slabs"]
    state_dict, weights, live, taken = saved
    snapshot = [] if freeze(live) == taken else ["state_dict() changed after later steps"]
    try:
        resumed: list | str = resume_ddp(rank, name, state_dict, weights, spy)
    except Exception as error:  # noqa: BLE001 - reported by its test; the others still run
        resumed = f"resuming raised {type(error).__name__}: {error}"
    return {"steps": steps, "resumed": resumed,
            "framing": [], "snapshot": snapshot, "slabs": slabs,
            "one_exchange": one_exchange_against_the_loop(rank, name, spy)}  # fmt: skip


def resume_ddp(rank: int, name: str, state_dict: dict, weights: dict, spy: SelectSpy) -> list:
    model = make_model()
    model.load_state_dict(weights)
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    state = SparseState(registered(name), DENSITY, **options_of(name))
    state.load_state_dict(state_dict)  # before the first backward, as documented
    ddp.register_comm_hook(state, sparse_hook)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    out = []
    for step in range(SAVE_AT, STEPS):
        optimizer.zero_grad()
        loss(ddp, step, rank).backward()
        spy.take()
        out.append(
            {
                "average": flat(p.grad for p in params),
                "after": flat(state.residual(p) for p in params),
                "stats": state.last_step,
            }
        )
        optimizer.step()
    return out


def one_exchange_against_the_loop(rank: int, name: str, spy: SelectSpy) -> dict:
    """The hook with one slab over DDP's several buckets, and the loop API over the same
    parameters in the order the hook met them: the project claims the same step, bit for
    bit (tests/test_ddp.py). Dense averaging ignores ``one_exchange`` and follows DDP's
    buckets, as DDP does; with two ranks each entry's sum is one addition, which no cut of
    the vector can change, so dense is held to the same claim here."""
    hooked, plain = make_model(), make_model()
    ddp = DDP(hooked, bucket_cap_mb=BUCKET_MB)
    state = SparseState(registered(name), DENSITY, one_exchange=True, **options_of(name))
    buckets: list[int] = []

    def counting_hook(state, bucket):  # unannotated: DDP checks annotations as objects
        buckets[-1] += 1
        return sparse_hook(state, bucket)

    ddp.register_comm_hook(state, counting_hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (hooked, plain)]
    reducer, pairs, differences = None, [], []
    for step in range(STEPS):
        buckets.append(0)
        for model, optimizer in zip((ddp, plain), optimizers):
            optimizer.zero_grad()
            loss(model, step, rank).backward()
        if reducer is None:  # the order the hook met them in, its slab's (as in test_ddp.py)
            met = state._binding.slabs.order
            by_id = {id(p): q for p, q in zip(hooked.parameters(), plain.parameters())}
            pairs = [(p, by_id[id(p)]) for p in met]
            reducer = GradientReducer(
                [q for _, q in pairs], registered(name), DENSITY, **options_of(name)
            )
        reducer.synchronize()
        spy.take()
        offset = 0
        for index, (p, q) in enumerate(pairs):
            residual = reducer.residual[offset : offset + q.numel()]
            if not torch.equal(p.grad, q.grad):
                differences.append(f"step {step}: average of parameter {index}")
            if not torch.equal(state.residual(p), residual):
                differences.append(f"step {step}: residual of parameter {index}")
            offset += q.numel()
        for field in ("selected", "target"):
            hook, loop = getattr(state.last_step, field), getattr(reducer.last_step, field)
            if hook != loop:
                differences.append(f"step {step}: {field} {hook} (hook) != {loop} (loop API)")
        for optimizer in optimizers:
            optimizer.step()
    return {"differences": differences, "buckets": buckets[-1]}


WORKERS = {"loop": loop_worker, "ddp": ddp_worker}
_LAUNCHES: dict[tuple[str, str], list[dict]] = {}


def launch(name: str, driver: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What every rank saw, from one launch per sparsifier and driver shared by the tests."""
    if (name, driver) not in _LAUNCHES:
        where = tmp_path_factory.mktemp(f"{driver}-{name}")
        _LAUNCHES[name, driver] = run_ranks(WORKERS[driver], WORLD, where, name)
    return _LAUNCHES[name, driver]


@pytest.fixture
def ranks(request, tmp_path_factory) -> list[dict]:
    params = request.node.callspec.params
    return launch(params["name"], params["driver"], tmp_path_factory)


contract = pytest.mark.parametrize(
    ("name", "driver"), [(name, driver) for name in NAMES for driver in WORKERS]
)


# ---------------------------------------------------------------------------------------------
# The tests.


@contract
def test_error_feedback_loses_nothing(name: str, driver: str, ranks: list[dict]) -> None:
    """Per rank: where nothing was sent the residual is what the rank had (its gradient plus
    its residual before), to the bit, and 0 where something was. Over the ranks, in float64:
    Σ_r (g_r + e_r) = n · average + Σ_r e'_r."""
    for t in range(STEPS):
        got = [rank["steps"][t] for rank in ranks]
        where = f"{name} ({driver}), step {t}"
        for r, seen in enumerate(got):
            had = seen["before"] + seen["fresh"]
            sent = seen["after"] == 0
            assert torch.equal(seen["after"][~sent], had[~sent]), f"{where}, rank {r}"
            assert torch.all(had[sent] != 0), f"{where}, rank {r}: a nonzero left as 0"
        had = sum(seen["before"] + seen["fresh"] for seen in got)
        kept = sum(seen["after"] for seen in got)
        torch.testing.assert_close(
            had, WORLD * got[0]["average"] + kept, rtol=1e-12, atol=1e-12, msg=where
        )
        if t > 0 and driver == "loop":  # the hook's "before" is the previous "after" itself
            assert all(torch.equal(g["before"], r["steps"][t - 1]["after"])
                       for g, r in zip(got, ranks)), where  # fmt: skip


@contract
def test_every_rank_ends_the_step_with_the_same_average(
    name: str, driver: str, ranks: list[dict]
) -> None:
    for t in range(STEPS):
        first = ranks[0]["steps"][t]
        for r, rank in enumerate(ranks[1:], 1):
            seen, where = rank["steps"][t], f"{name} ({driver}), step {t}, rank {r}"
            assert torch.equal(seen["average"], first["average"]), where
            for field in GLOBAL_FIELDS:
                mine, theirs = getattr(seen["stats"], field), getattr(first["stats"], field)
                assert mine == theirs, f"{where}: {field} {mine} != {theirs} on rank 0"
            assert seen["stats"].step == t, where


@contract
def test_positions_are_distinct_and_counted(name: str, driver: str, ranks: list[dict]) -> None:
    """Every rank's ``select`` returns distinct int64 positions of its slab; the statistics
    count what was proposed, sent and averaged; dense averages everything."""
    for t in range(STEPS):
        got = [rank["steps"][t] for rank in ranks]
        stats = got[0]["stats"]
        where = f"{name} ({driver}), step {t}"
        sent = got[0]["after"] == 0
        assert all(torch.equal(seen["after"] == 0, sent) for seen in got), where  # the union
        assert int(sent.sum()) == stats.selected, f"{where}: {int(sent.sum())} sent"
        assert torch.equal(got[0]["average"] != 0, sent), where
        if stats.exchange == "dense":
            assert stats.selected == stats.numel, where
            assert all(seen["proposals"] == [] for seen in got), where
            continue
        proposed = []
        for r, seen in enumerate(got):
            counts, sending = [], []
            for proposal in seen["proposals"]:
                positions = proposal["positions"]
                assert positions.dtype == torch.int64 and positions.dim() == 1, where
                assert positions.unique().numel() == positions.numel(), (
                    f"{where}, rank {r}: a position proposed twice: {sorted(positions.tolist())}"
                )
                assert bool(((positions >= 0) & (positions < proposal["numel"])).all()), where
                counts.append(positions.numel())
                capacity = proposal["capacity"]  # a fixed message sends at most its capacity
                sending.append(positions.numel() if capacity is None
                               else min(positions.numel(), capacity))  # fmt: skip
            proposed.append(sum(counts))
            assert seen["stats"].local_selected == sum(sending), f"{where}, rank {r}"
        if stats.exchange == "shared":  # every rank proposes the same positions
            assert len(set(proposed)) == 1 and stats.selected == proposed[0], where
            if driver == "loop":
                assert all(torch.equal(seen["proposals"][0]["positions"].sort().values,
                                       got[0]["proposals"][0]["positions"].sort().values)
                           for seen in got), where  # fmt: skip
            continue
        assert stats.proposed == sum(proposed), where
        if stats.exchange != "union":  # no deduplication: no two ranks may send one position
            assert sum(seen["stats"].local_selected for seen in got) == stats.selected, where
        if driver == "loop":  # one slab: the positions are the flat vector's
            union = torch.unique(torch.cat([seen["proposals"][0]["positions"] for seen in got]))
            averaged = torch.nonzero(sent).squeeze(1)
            assert bool(torch.isin(averaged, union).all()), where
            if stats.exchange != "fixed":  # else a full message leaves the rest in the residual
                assert torch.equal(averaged, union), where


KNOWN_DEFECTS: dict[tuple[str, str, str], str] = {}
"""Invariants a registered sparsifier is known to break, each a defect to fix: strict, so that
the fix makes its test fail until its line here goes."""


@pytest.fixture(autouse=True)
def known_defect(request) -> None:
    params = getattr(request.node, "callspec", None)
    params = {} if params is None else params.params
    reason = KNOWN_DEFECTS.get(
        (request.node.originalname, params.get("name"), params.get("driver"))
    )
    if reason is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


@contract
def test_state_dict_resumes_bit_for_bit(name: str, driver: str, ranks: list[dict]) -> None:
    """Saved after step 2, loaded into a fresh model and reducer (or hook state), the next
    steps are the uninterrupted run's; and the saved state is a snapshot."""
    for r, rank in enumerate(ranks):
        assert rank["snapshot"] == [], f"{name} ({driver}), rank {r}"
        assert not isinstance(rank["resumed"], str), f"{name} ({driver}): {rank['resumed']}"
        for t, resumed in enumerate(rank["resumed"], SAVE_AT):
            original, where = rank["steps"][t], f"{name} ({driver}), step {t}, rank {r}"
            assert torch.equal(resumed["average"], original["average"]), where
            assert torch.equal(resumed["after"], original["after"]), where
            for field in ("selected", "local_selected", "proposed", "threshold"):
                a, b = getattr(resumed["stats"], field), getattr(original["stats"], field)
                assert _number(a) == _number(b), f"{where}: {field} {a} != {b}"


@contract
def test_framing_is_pure(name: str, driver: str, ranks: list[dict]) -> None:
    """Two calls of ``framing()`` on every slab's sparsifier, after construction and after
    every step, describe the same framing and change nothing in the sparsifier."""
    for r, rank in enumerate(ranks):
        assert rank["framing"] == [], f"{name} ({driver}), rank {r}"
        for t, seen in enumerate(rank["steps"]):
            for proposal in seen["proposals"]:
                assert proposal["framing"] == [], f"{name} ({driver}), step {t}, rank {r}"


@pytest.mark.parametrize("name", NAMES)
def test_the_hook_over_one_slab_is_the_loop_api(name: str, tmp_path_factory) -> None:
    """Shares the DDP launch: its ranks also ran ``one_exchange`` beside a reducer."""
    for r, rank in enumerate(launch(name, "ddp", tmp_path_factory)):
        assert rank["slabs"] > 1, "the hook's own run must average several slabs"
        assert rank["one_exchange"]["buckets"] > 1, "one slab must span several DDP buckets"
        assert rank["one_exchange"]["differences"] == [], f"{name}, rank {r}"


@pytest.mark.parametrize("name", NAMES)
def test_what_the_wire_sends_is_what_it_prices_and_records(name: str) -> None:
    """``wire_values`` (which a state's checkpoint records and a budget prices) is the dtype
    the bound sparsifier's framing sends, on every number of ranks, and ``entry_bytes``
    prices that framing at that dtype and the sparsifier's density."""
    base, options = VARIANTS.get(name, (name, {}))
    layout = Layout.of([("w", torch.zeros(70_000)), ("b", torch.zeros(30))])
    for world_size in (1, 4, 16, 17, 64):
        sparsifier = create_sparsifier(base, DENSITY, **options)
        sparsifier.bind(layout, rank=world_size - 1, world_size=world_size)
        framing, values = sparsifier.framing(), sparsifier.wire_values(world_size)
        assert framing.value_dtype == values, (name, world_size)
        priced = type(framing).entry_bytes(values, DENSITY)
        assert sparsifier.entry_bytes(world_size=world_size) == priced
