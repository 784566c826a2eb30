"""The DDP communication hook on real gloo ranks: the same step as GradientReducer."""

from __future__ import annotations

import copy
import itertools
import math
import pickle

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import microsparse.ddp as mddp
from distributed import run_ranks
from microsparse import EveryRank, GradientReducer, NonFiniteGradientError


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 40), nn.ReLU(), nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 4)
    )


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 12, generator=torch.Generator().manual_seed(100 * step + rank)) * 3


def train(model: nn.Module, steps: range, rank: int, optimizer: torch.optim.Optimizer) -> None:
    for step in steps:
        optimizer.zero_grad()
        model(batch(step, rank)).pow(2).mean().backward()
        optimizer.step()


FLAGS = list(itertools.product(["micro", "topk", "dense"], [False, True], [False, True]))


def density_one_worker(rank: int, n: int) -> list[bool]:
    return [same_as_stock_ddp(rank, *flags) for flags in FLAGS]


def same_as_stock_ddp(rank: int, sparsifier: str, bucket_view: bool, static: bool) -> bool:
    plain, hooked = mlp(), mlp()
    stock = DDP(
        plain, gradient_as_bucket_view=bucket_view, static_graph=static, bucket_cap_mb=0.005
    )
    ours = DDP(
        hooked, gradient_as_bucket_view=bucket_view, static_graph=static, bucket_cap_mb=0.005
    )
    ours.register_comm_hook(mddp.SparseState(sparsifier, density=1.0), mddp.sparse_hook)
    equal = True
    for step in range(4):
        for model in (stock, ours):
            model.zero_grad()
            model(batch(step, rank)).pow(2).mean().backward()
        equal &= all(
            torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), hooked.parameters())
        )
    return equal


def test_density_one_equals_stock_ddp_bit_for_bit(tmp_path) -> None:
    """Every hook sparsifier, with and without gradient_as_bucket_view and static_graph."""
    for rank_result in run_ranks(density_one_worker, 2, tmp_path):
        assert dict(zip(FLAGS, rank_result)) == dict.fromkeys(FLAGS, True)


# ---------------------------------------------------------------------------------------------
# One method: with one slab holding the whole model, the hook is GradientReducer.

CROSS_CHECK = [
    ("micro", {}),
    ("micro", {"selection": "threshold"}),
    ("micro", {"threshold_rule": "as_coded", "partitioning": "contiguous",
               "index_message": "padded"}),
    ("micro", {"momentum_correction": 0.9}),
    ("micro", {"momentum_correction": 0.9, "momentum_nesterov": True}),
    ("micro", {"density_warmup": (0.5, 4)}),  # the fixed message's overflow round
    ("micro", {"adam_correction": (0.25, 0.9949, 1e-8)}),
    ("micro", {"selection": "threshold", "density_warmup": (0.5, 4)}),
    ("topk", {}),
    ("hard_threshold", {}),
    ("sage", {"seed": 3}),
    ("cltk", {}),
    ("deft", {}),
    ("oracle", {}),
]  # fmt: skip


def cross_check_worker(rank: int, n: int, steps: int) -> list[bool]:
    """Hook and reducer side by side on identical models and batches, compared bit for bit."""
    results = []
    for name, options in CROSS_CHECK:
        hooked, plain = mlp().double(), mlp().double()
        ddp = DDP(hooked, bucket_cap_mb=100)  # one bucket, in reverse order once rebuilt
        state = mddp.SparseState(name, 0.05, **options)
        # Pin the slab to the rebuilt bucket's order from the first pass, with zero residuals:
        # the restored-checkpoint path (the first pass spans DDP's first bucket in pieces).
        params = list(hooked.parameters())
        count = len(params)
        state.load_state_dict(
            {
                **state.state_dict(),
                "rank": rank,
                "world_size": n,
                "slabs": {
                    "residuals": [torch.zeros(p.numel(), dtype=p.dtype) for p in params],
                    "velocities": [torch.zeros(p.numel(), dtype=p.dtype) for p in params],
                    "slabs": [list(range(count - 1, -1, -1))],
                    "states": [{}],
                },
            }
        )
        ddp.register_comm_hook(state, mddp.sparse_hook)
        reversed_plain = list(reversed(list(plain.parameters())))
        reducer = GradientReducer(reversed_plain, name, 0.05, **options)
        equal = True
        for step in range(steps):
            x = batch(step, rank).double()
            for model in (ddp, plain):
                model.zero_grad()
                model(x).pow(2).mean().backward()
            reducer.synchronize()
            equal &= _same_as_reducer(hooked, plain, state, reducer)
        results.append(equal)
    return results


def _same_as_reducer(
    hooked: nn.Module, plain: nn.Module, state: mddp.SparseState, reducer: GradientReducer
) -> bool:
    """Gradients, residuals, velocities, moments and counts of the hook and the reducer of
    the same step, all bit for bit."""
    equal = True
    for a, b in zip(hooked.parameters(), plain.parameters()):
        equal &= torch.equal(a.grad, b.grad)
        where = slice(_offset(reducer, b), _end(reducer, b))
        equal &= torch.equal(state.residual(a), reducer.residual[where])
        velocity = state.velocity(a)
        equal &= (velocity is None) == (reducer.velocity is None)
        equal &= velocity is None or torch.equal(velocity, reducer.velocity[where])
        moments, mine = state.moments(a), reducer.moments
        equal &= (moments is None) == (mine is None)
        equal &= moments is None or all(torch.equal(x, y[where]) for x, y in zip(moments, mine))
    return equal and state.last_step.selected == reducer.last_step.selected


def _offset(reducer: GradientReducer, param: torch.Tensor) -> int:
    index = [id(p) for p in reducer._params].index(id(param))
    return reducer.layout.offsets[index]


def _end(reducer: GradientReducer, param: torch.Tensor) -> int:
    return _offset(reducer, param) + param.numel()


@pytest.mark.parametrize("n", [2, 3])
def test_one_slab_hook_equals_the_reducer_bit_for_bit(n: int, tmp_path) -> None:
    for rank_result in run_ranks(cross_check_worker, n, tmp_path, 5):
        assert dict(zip(map(str, CROSS_CHECK), rank_result)) == dict.fromkeys(
            map(str, CROSS_CHECK), True
        )


# One exchange per pass: with ``one_exchange`` the hook is the reducer over DDP's many buckets,
# from the first pass on, through DDP's rebuild, with or without bucket views.

ONE_EXCHANGE = [
    ("micro", {}),
    ("micro", {"selection": "threshold"}),  # a threshold carried from pass to pass
    ("micro", {"momentum_correction": 0.9}),
    ("micro", {"density_warmup": (0.5, 4)}),
    ("topk", {}),
    ("cltk", {}),
    ("oracle", {}),
]
DDP_FLAGS = [(False, False), (True, True)]  # (gradient_as_bucket_view, static_graph)


def one_exchange_worker(rank: int, n: int, steps: int) -> list[bool]:
    results = []
    for (name, options), (view, static) in itertools.product(ONE_EXCHANGE, DDP_FLAGS):
        hooked, plain = mlp().double(), mlp().double()
        ddp = DDP(hooked, bucket_cap_mb=0.005, gradient_as_bucket_view=view, static_graph=static)
        state = mddp.SparseState(name, 0.05, one_exchange=True, **options)
        buckets: list[int] = []

        def counting_hook(state, bucket):  # unannotated: DDP checks annotations as objects
            buckets[-1] += 1  # noqa: B023 - runs within this iteration's backward passes
            return mddp.sparse_hook(state, bucket)

        ddp.register_comm_hook(state, counting_hook)
        reducer, equal = None, True
        for step in range(steps):
            buckets.append(0)
            x = batch(step, rank).double()
            for model in (ddp, plain):
                model.zero_grad()
                model(x).pow(2).mean().backward()
            if reducer is None:  # the hook's slab holds the parameters in the order it met them
                met = state._binding.slabs.order
                index = [next(i for i, p in enumerate(hooked.parameters()) if p is q) for q in met]
                plain_params = list(plain.parameters())
                reducer = GradientReducer([plain_params[i] for i in index], name, 0.05, **options)
            reducer.synchronize()
            equal &= _same_as_reducer(hooked, plain, state, reducer)
            equal &= state.last_step.extra["slabs"] == 1
            if name == "micro" and not {"selection", "density_warmup"} & set(options):
                k = math.floor(0.05 * sum(p.numel() for p in hooked.parameters()))
                equal &= state.last_step.selected == state.last_step.target == k  # not split
        # DDP's first bucket holds 1 MiB, the rebuilt ones bucket_cap_mb: several by now.
        results.append(equal and buckets[-1] > 1)
    return results


@pytest.mark.parametrize("n", [2, 3])
def test_one_exchange_hook_equals_the_reducer_over_many_buckets(n: int, tmp_path) -> None:
    cases = [f"{case} {flags}" for case, flags in itertools.product(ONE_EXCHANGE, DDP_FLAGS)]
    for rank_result in run_ranks(one_exchange_worker, n, tmp_path, 6):
        assert dict(zip(cases, rank_result)) == dict.fromkeys(cases, True)


# ---------------------------------------------------------------------------------------------
# Many slabs: exact density from the first pass, residuals that follow the rebuild.


class Probe(nn.Module):
    """d = 6,000 parameters in four tensors whose gradient is whatever input it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(2000))
        self.b = nn.Parameter(torch.zeros(100, 30))
        self.c = nn.Parameter(torch.zeros(70))
        self.d = nn.Parameter(torch.zeros(930))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = torch.cat([self.a, self.b.flatten(), self.c, self.d])
        return (flat * x).sum()


def probe_gradient(step: int, rank: int) -> torch.Tensor:
    scales = torch.cat([torch.full((2000,), 0.3), torch.full((3000,), 1.0),
                        torch.full((70,), 0.01), torch.full((930,), 3.0)])  # fmt: skip
    generator = torch.Generator().manual_seed(7 * step + rank)
    return torch.randn(6000, generator=generator, dtype=torch.float64) * scales


def rebuild_worker(
    rank: int, n: int, name: str, static: bool, steps: int, momentum: float, wire: str | None
) -> dict:
    model = Probe().double()
    ddp = DDP(model, bucket_cap_mb=0.02, static_graph=static)
    options = ({} if wire is None else {"value_dtype": torch.bfloat16} if wire == "bfloat16"
               else {"wire": wire})  # fmt: skip
    state = mddp.SparseState(name, 0.01, momentum_correction=momentum, **options)
    layouts: list[list[tuple[int, ...]]] = []

    def logging_hook(state, bucket):  # unannotated: DDP checks annotations as objects
        layouts[-1].append(tuple(p.numel() for p in bucket.parameters()))
        return mddp.sparse_hook(state, bucket)

    ddp.register_comm_hook(state, logging_hook)
    records = []
    for step in range(steps):
        layouts.append([])
        model.zero_grad()
        ddp(probe_gradient(step, rank)).backward()
        records.append(
            {
                "grad": torch.cat([p.grad.flatten() for p in model.parameters()]).clone(),
                "residual": torch.cat([state.residual(p) for p in model.parameters()]).clone(),
                "velocity": torch.cat([state.velocity(p) for p in model.parameters()]).clone()
                if momentum
                else None,
                "selected": state.last_step.selected,
                "target": state.last_step.target,
            }
        )
    return {"records": records, "layouts": layouts}


@pytest.mark.parametrize(
    ("name", "static", "momentum", "wire"),
    [("micro", False, 0.0, "plain"), ("micro", True, 0.0, "plain"), ("topk", False, 0.0, None),
     ("topk", False, 0.0, "fixed"), ("micro", False, 0.9, "plain"), ("micro", False, 0.0, None),
     ("micro", True, 0.0, None), ("micro", False, 0.0, "bfloat16")],
)  # fmt: skip
def test_every_pass_conserves_and_micro_selects_k_across_the_rebuild(
    name, static, momentum, wire, tmp_path
):
    """To the bit on the plain wire, and to float64's rounding with MiCRO's default 8-bit
    values (their sum is exact, each rank's rounding stays in its residual); with bfloat16
    values each rank's rounding stays in its residual, and only the all-reduce's one
    bfloat16 sum rounds."""
    n, steps = 2, 6
    ranks = run_ranks(rebuild_worker, n, tmp_path, name, static, steps, momentum, wire)
    exact, integers = wire != "bfloat16", name == "micro" and wire is None
    layouts = ranks[0]["layouts"]
    assert layouts[-1] != layouts[0] and len(layouts[-1]) > 1  # DDP rebuilt, several slabs
    previous = [torch.zeros(6000, dtype=torch.float64) for _ in range(n)]
    velocity = [torch.zeros(6000, dtype=torch.float64) for _ in range(n)]
    for step in range(steps):
        got = [rank["records"][step] for rank in ranks]
        for r in range(n):
            assert torch.equal(got[r]["grad"], got[0]["grad"]), step
        if name == "micro":  # k = ⌊0.01 · 6000⌋ = 60, from the first pass on
            assert got[0]["selected"] == got[0]["target"] == 60, step
        # Momentum correction: u ← m·u + g is what the residual accumulates; the velocities,
        # like the residuals, follow their parameters into the rebuilt slabs.
        velocity = [momentum * velocity[r] + probe_gradient(step, r) for r in range(n)]
        # Conservation of error feedback: Σ_r a_r = n · average + Σ_r e_r, through the rebuild.
        accumulated = sum(previous[r] + velocity[r] for r in range(n))
        kept = sum(got[r]["residual"] for r in range(n))
        sent = got[0]["grad"] != 0
        if integers:  # a sum of integers may be 0 where every rank's value rounded to 0
            assert 0 < int(sent.sum()) <= got[0]["selected"], step
        else:
            assert int(sent.sum()) == got[0]["selected"], step
        if exact:
            torch.testing.assert_close(accumulated, n * got[0]["grad"] + kept, rtol=1e-12,
                                       atol=1e-12)  # fmt: skip
        else:  # one bfloat16 addition of two ranks' values: at most 2^-8 of the sum
            lost = (accumulated - n * got[0]["grad"] - kept).abs()
            assert torch.all(lost <= 2**-8 * (n * got[0]["grad"]).abs() + 1e-12), step
            assert lost[sent].max() > 0 and torch.all(lost[~sent] <= 1e-12), step
        for r in range(n):
            if integers:  # what rounding to its level took: at most the whole value
                own = (previous[r] + velocity[r])[sent].abs()
                assert torch.all(got[r]["residual"][sent].abs() <= own), step
            elif exact:
                assert torch.all(got[r]["residual"][sent] == 0), step
            else:  # the rank's own rounding of what it sent: at most 2^-8 of its value
                own = (previous[r] + velocity[r])[sent].abs()
                assert torch.all(got[r]["residual"][sent].abs() <= 2**-8 * own), step
            if momentum:  # factor masking: the velocity restarts where a value was sent
                velocity[r][sent] = 0
                # The fused kernel's multiply-add may round once where m·u + g rounds twice.
                torch.testing.assert_close(got[r]["velocity"], velocity[r], rtol=1e-15, atol=1e-15)
        previous = [got[r]["residual"] for r in range(n)]


# ---------------------------------------------------------------------------------------------
# The hook's own thread: the slabs' steps start there, and nothing else changes.

OWN_THREAD = [
    ("micro", {}),
    ("micro", {"wire": "plain"}),
    ("micro", {"value_dtype": torch.int8}),
    ("micro", {"selection": "threshold", "momentum_correction": 0.9}),
    ("topk", {}),
    ("cltk", {}),
    ("micro", {"one_exchange": True}),
]  # fmt: skip


def own_thread_worker(rank: int, n: int, steps: int) -> list[bool]:
    """The same training with and without ``own_thread``, side by side over DDP's many
    buckets (each bucket's step started on the hook's thread), compared bit for bit."""
    results = []
    for name, options in OWN_THREAD:
        models = [mlp(), mlp()]
        states = [mddp.SparseState(name, 0.05, own_thread=own, **options) for own in (False, True)]
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
        ddps = [DDP(m, bucket_cap_mb=0.001) for m in models]
        for ddp, state in zip(ddps, states):
            ddp.register_comm_hook(state, mddp.sparse_hook)
        for step in range(steps):
            for ddp, optimizer in zip(ddps, optimizers):
                optimizer.zero_grad()
                ddp(batch(step, rank)).pow(2).mean().backward()
                optimizer.step()
        inline, threaded = (list(m.parameters()) for m in models)
        starters = [state._binding.starter._thread for state in states]
        results.append(
            all(torch.equal(a, b) for a, b in zip(inline, threaded))
            and all(torch.equal(states[0].residual(a), states[1].residual(b))
                    for a, b in zip(inline, threaded))  # fmt: skip
            and states[0].last_step.selected == states[1].last_step.selected
            and (states[1].last_step.extra["slabs"] > 1) != bool(options.get("one_exchange"))
            and starters[0] is None  # on the CPU the default starts steps on autograd's thread
            and starters[1] is not None and starters[1].is_alive()
        )
    return results


@pytest.mark.parametrize("n", [2, 3])
def test_own_thread_trains_the_same_bit_for_bit(n: int, tmp_path) -> None:
    for rank_result in run_ranks(own_thread_worker, n, tmp_path, 5):
        assert dict(zip(map(str, OWN_THREAD), rank_result)) == dict.fromkeys(
            map(str, OWN_THREAD), True
        )


# ---------------------------------------------------------------------------------------------
# Checkpoints, pickling, dtypes, unused parameters, errors.


def resume_worker(rank: int, n: int, steps: int, stop_at: int, options: dict) -> list[bool]:
    def fresh() -> tuple[nn.Module, DDP, torch.optim.Optimizer, mddp.SparseState]:
        model = mlp()
        ddp = DDP(model, bucket_cap_mb=0.005)
        state = mddp.MicroState(density=0.05, **options)
        ddp.register_comm_hook(state, mddp.micro_hook)
        return model, ddp, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), state

    model, ddp, optimizer, state = fresh()
    train(ddp, range(stop_at), rank, optimizer)
    checkpoint = copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
         "hook": state.state_dict()}
    )  # fmt: skip
    train(ddp, range(stop_at, steps), rank, optimizer)
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    model, ddp, optimizer, state = fresh()
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    state.load_state_dict(checkpoint["hook"])
    train(ddp, range(stop_at, steps), rank, optimizer)
    return [torch.equal(a, b) for a, b in zip(uninterrupted, model.parameters())]


@pytest.mark.parametrize(
    "options",
    [{}, {"threshold_rule": "symmetric"}, {"momentum_correction": 0.9},
     {"adam_correction": (0.9, 0.999, 1e-8)}, {"one_exchange": True}],  # fmt: skip
)
def test_resumed_training_equals_uninterrupted(options, tmp_path) -> None:
    for equal in run_ranks(resume_worker, 2, tmp_path, 10, 5, options):
        assert all(equal)


def pickle_worker(rank: int, n: int) -> list[bool]:
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = mddp.MicroState(density=0.05)
    ddp.register_comm_hook(state, mddp.micro_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    train(ddp, range(3), rank, optimizer)
    copied, unpickled = copy.deepcopy(state), pickle.loads(pickle.dumps(state))
    # A copy carries the step and residuals; into a fresh DDP model it continues the run.
    results = [copied.step == unpickled.step == 3]
    again = mlp()
    again.load_state_dict(model.state_dict())
    twin = DDP(again, bucket_cap_mb=0.005)
    twin.register_comm_hook(unpickled, mddp.micro_hook)
    twin_optimizer = torch.optim.SGD(again.parameters(), lr=0.05)
    train(ddp, range(3, 5), rank, optimizer)
    train(twin, range(3, 5), rank, twin_optimizer)
    results += [torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters())]
    return results


def test_state_pickles_and_deep_copies_and_continues(tmp_path) -> None:
    for results in run_ranks(pickle_worker, 2, tmp_path):
        assert all(results)


def test_state_can_be_built_before_the_process_group() -> None:
    state = mddp.SparseState("micro", 0.01, threshold_rule="as_coded")
    assert state.rank is None
    assert pickle.loads(pickle.dumps(state)).options == {"threshold_rule": "as_coded"}
    state = mddp.SparseState("micro", 0.01, one_exchange=True, adam_correction=(0.9, 0.99, 1e-8))
    copied = pickle.loads(pickle.dumps(state))
    assert copied.one_exchange and copied.sparse_options == state.sparse_options


def test_a_state_of_other_slabs_is_refused() -> None:
    """One slab or DDP's buckets: the saved thresholds belong to other slabs."""
    with pytest.raises(ValueError, match="saved with options"):
        mddp.SparseState("micro", 0.01, one_exchange=True).load_state_dict(
            mddp.SparseState("micro", 0.01).state_dict()
        )


def restore_errors_worker(rank: int, n: int) -> dict:
    """The two Accelerate mistakes: load_state() after training, a state saved on rank 0 only."""
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = mddp.MicroState(density=0.05)
    ddp.register_comm_hook(state, mddp.micro_hook)
    train(ddp, range(2), rank, torch.optim.SGD(model.parameters(), lr=0.05))
    messages = {}
    try:  # save_state() then load_state() in the same run
        state.load_state_dict(state.state_dict())
    except RuntimeError as error:
        messages["trained"] = str(error)
    main_only = [state.state_dict()]  # what register_for_checkpointing(state) hands every rank
    torch.distributed.broadcast_object_list(main_only, src=0)
    fresh = mddp.MicroState(density=0.05)
    DDP(mlp(), bucket_cap_mb=0.005).register_comm_hook(fresh, mddp.micro_hook)
    try:  # before the first backward: refused at load time, not in rank 1's hook alone
        fresh.load_state_dict(main_only[0])
    except ValueError as error:
        messages["state"] = str(error)
    reducer = GradientReducer(mlp(), "micro", 0.05)
    main_only = [reducer.state_dict()]
    torch.distributed.broadcast_object_list(main_only, src=0)
    try:
        reducer.load_state_dict(main_only[0])
    except ValueError as error:
        messages["reducer"] = str(error)
    # The advice works: EveryRank's file, as the main process saves it, restores every rank.
    every_rank = [EveryRank(state).state_dict()]
    torch.distributed.broadcast_object_list(every_rank, src=0)
    EveryRank(fresh).load_state_dict(every_rank[0])
    messages["restored step"] = fresh.step
    return messages


def test_a_restore_too_late_or_on_another_rank_says_what_to_do(tmp_path) -> None:
    rank0, rank1 = run_ranks(restore_errors_worker, 2, tmp_path)
    for messages in (rank0, rank1):
        trained = messages["trained"]
        assert trained.startswith("load_state_dict must be called before the first backward pass")
        assert "with Accelerate: call accelerator.load_state() before the first step" in trained
        assert "build a fresh model and state, register the hook on it, and load" in trained
        assert messages["restored step"] == 2
    assert "state" not in rank0 and "reducer" not in rank0  # rank 0's own state loads
    for name in ("state", "reducer"):
        message = rank1[name]
        assert "saved by rank 0 of 2, but is loaded on rank 1 of 2" in message
        assert f"register microsparse.EveryRank({name}) instead of the {name} itself" in message
        assert f"accelerator.register_for_checkpointing(microsparse.EveryRank({name}))" in message


def test_a_state_of_another_world_size_says_how_many_ranks() -> None:
    with pytest.raises(ValueError, match="on rank 0 of 1; resume with 4 ranks, as it was saved"):
        GradientReducer(nn.Linear(3, 2), "micro", 0.5).load_state_dict({"rank": 2, "world_size": 4})


def half_worker(rank: int, n: int, dtype: torch.dtype) -> dict:
    model = mlp().to(dtype)
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = mddp.MicroState(density=0.05)
    ddp.register_comm_hook(state, mddp.micro_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        optimizer.zero_grad()
        ddp(batch(step, rank).to(dtype)).float().pow(2).mean().backward()
        optimizer.step()
    first = next(model.parameters())
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grad_dtype": first.grad.dtype,
        "residual_dtype": state.residual(first).dtype,
        "selected": state.last_step.selected,
        "target": state.last_step.target,
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_train_with_float32_residuals(dtype, tmp_path) -> None:
    first, second = run_ranks(half_worker, 2, tmp_path, dtype)
    assert first["grad_dtype"] == dtype and first["residual_dtype"] == torch.float32
    assert first["selected"] == first["target"]
    for a, b in zip(first["params"], second["params"]):
        assert torch.isfinite(a.float()).all() and torch.equal(a, b)


class SometimesUsed(nn.Module):
    """``branch`` is used in the first steps only, then unused on every rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.use_branch = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.trunk(x)
        return self.branch(y) if self.use_branch else y


def unused_worker(rank: int, n: int, name: str, one_exchange: bool, options: dict) -> dict:
    model = SometimesUsed().double()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.001 if one_exchange else 25)
    state = mddp.SparseState(name, 0.2, one_exchange=one_exchange, **options)
    ddp.register_comm_hook(state, mddp.sparse_hook)
    generator = torch.Generator().manual_seed(rank)
    frozen_residuals = []
    for step in range(8):
        model.use_branch = step < 3
        model.zero_grad()
        ddp(torch.randn(4, 8, generator=generator, dtype=torch.float64)).pow(2).sum().backward()
        if step >= 3:
            frozen_residuals.append(
                torch.cat([state.residual(p) for p in model.branch.parameters()]).clone()
            )
    return {
        "frozen": frozen_residuals,
        "params": [p.detach().clone() for p in model.parameters()],
        "branch_grads": [p.grad for p in model.branch.parameters()],
    }


@pytest.mark.parametrize(
    ("name", "one_exchange", "options"),
    [("micro", False, {}), ("cltk", False, {}), ("deft", False, {}), ("oracle", False, {}),
     ("micro", True, {}), ("cltk", True, {}), ("topk", False, {"wire": "fixed"})],
)  # fmt: skip
def test_unused_parameters_keep_their_residual_instead_of_losing_it(
    name, one_exchange, options, tmp_path
) -> None:
    """While the branch is unused on every rank DDP drops its average: nothing of it may be
    sent, so its residual (left from the steps that used it) must stay exactly as it was. A
    leader's plan (CLT-k, DEFT) or the oracle's sum may still name its positions: every rank
    then sends 0 there."""
    ranks = run_ranks(unused_worker, 2, tmp_path, name, one_exchange, options)
    for result in ranks:
        first = result["frozen"][0]
        assert first.abs().sum() > 0  # the steps that used the branch left a residual
        assert all(torch.equal(first, later) for later in result["frozen"][1:])
        assert all(grad is None for grad in result["branch_grads"])
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)


def nonfinite_worker(rank: int, n: int, nonfinite: str, own_thread: bool = False) -> dict:
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=0.001)  # several slabs
    state = mddp.MicroState(density=0.1, nonfinite=nonfinite, own_thread=own_thread)
    ddp.register_comm_hook(state, mddp.micro_hook)
    outcomes, residuals, grads, skipped = [], [], [], []
    for step in range(4):
        model.zero_grad()
        x = batch(step, rank)
        if step == 2 and rank == 0:
            x[0, 0] = math.inf
        try:
            ddp(x).pow(2).mean().backward()
            outcomes.append("ok")
            skipped.append(state.last_step.skipped)
        except NonFiniteGradientError as error:
            outcomes.append(str(error))
            skipped.append(None)
        residuals.append(torch.cat([state.residual(p) for p in model.parameters()]).clone())
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
    return {"outcomes": outcomes, "residuals": residuals, "grads": grads, "skipped": skipped,
            "step": state.step}  # fmt: skip


def test_a_nonfinite_gradient_skips_the_pass_on_every_rank_and_keeps_every_residual(
    tmp_path,
) -> None:
    """By default nothing is raised and nothing is read back: the pass with an Inf on rank 0
    changes no residual anywhere, writes NaN where it averaged (the same on every rank), and
    training goes on."""
    ranks = run_ranks(nonfinite_worker, 2, tmp_path, "skip")
    for result in ranks:
        assert result["outcomes"] == ["ok"] * 4
        assert result["skipped"] == [False, False, True, False]
        assert torch.equal(result["residuals"][2], result["residuals"][1])
        assert torch.isnan(result["grads"][2]).any()
        assert torch.isfinite(result["grads"][3]).all()
        assert result["step"] == 4
    assert torch.equal(ranks[0]["grads"][2].isnan(), ranks[1]["grads"][2].isnan())


@pytest.mark.parametrize("own_thread", [False, True])
def test_nonfinite_raise_raises_itself_on_every_rank_after_ddp_finished(
    own_thread: bool, tmp_path
) -> None:
    """With nonfinite="raise" the error is the library's own, on every rank, in the same pass,
    with every residual as before; DDP has finished that pass, so the next backward runs. The
    same where the steps start on the hook's own thread (the error raised there reaches
    ``backward()``)."""
    ranks = run_ranks(nonfinite_worker, 2, tmp_path, "raise", own_thread)
    for rank, result in enumerate(ranks):
        outcomes = result["outcomes"]
        assert outcomes[:2] == ["ok", "ok"] and outcomes[3] == "ok", outcomes
        assert outcomes[2].startswith("step 2: NaN or Inf gradient "), outcomes[2]
        whose = "in parameter " if rank == 0 else "on rank 0; this rank's own gradient was finite"
        assert whose in outcomes[2], outcomes[2]
        assert torch.equal(result["residuals"][2], result["residuals"][1])
        assert result["step"] == 3  # the failed pass is not counted


def test_bad_options_name_the_argument() -> None:
    messages = []
    for kwargs in (
        {"sparsifier": "nope"},
        {"density": 0},
        {"capacity_factor": 0.5},
        {"threshold_rule": "x"},
        {"value_dtype": torch.float64},
        {"one_exchange": "yes"},
        {"own_thread": 1},
    ):
        with pytest.raises((ValueError, TypeError)) as error:
            mddp.SparseState(**kwargs)
        messages.append(str(error.value))
    assert [m.split(" ")[0] for m in messages] == [
        "sparsifier",
        "density",
        "capacity_factor",
        "threshold_rule",
        "value_dtype",
        "one_exchange",
        "own_thread",
    ]
