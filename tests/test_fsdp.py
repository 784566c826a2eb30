"""microsparse.fsdp on real FSDP2: 4 gloo ranks as 2 replicas × 2 shards.

Against hybrid sharding itself (density 1 gives its gradients bit for bit), against the
invariants of error feedback per shard (what every replica had, gradient plus residual, is
what was averaged plus what stayed behind), replicas identical after every step, exactly k
entries a step over the whole model, exact resume, and bad input refused on every rank.
Momentum correction, Adam correction and the density warm-up against a float64 reference of
what each shard's residual accumulates, and their buffers through an exact resume.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import microsparse
from distributed import run_ranks

pytest.importorskip("torch.distributed.fsdp")
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: E402

STEPS = 3


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 5))  # fmt: skip


def sharded(mesh, policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """The model with each Linear and the whole model wrapped by FSDP2 over ``mesh``."""
    model = net()
    policy = policy or MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no ReduceOp.AVG
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def local_grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.to_local().clone() for p in model.parameters()]


def same(steps: list, others: list) -> bool:
    """Every gradient of every step equal, bit for bit."""
    return all(torch.equal(a, b) for x, y in zip(steps, others) for a, b in zip(x, y))


def train(model: nn.Module, rank: int, steps: range, each=lambda step: None) -> list:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in steps:
        optimizer.zero_grad()
        model(batch(step, rank)).pow(2).mean().backward()
        seen.append(local_grads(model))
        each(step)
        optimizer.step()
    return seen


def dense_worker(rank: int, n: int, one_exchange: bool) -> bool:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hybrid = train(sharded(mesh), rank, range(STEPS))
    model = sharded(mesh["shard"])
    microsparse.fsdp.sparsify(model, mesh["replicate"], density=1.0, one_exchange=one_exchange)
    return same(hybrid, train(model, rank, range(STEPS)))


@pytest.mark.parametrize("one_exchange", [False, True])
def test_density_one_is_hybrid_sharding_bit_for_bit(one_exchange, tmp_path) -> None:
    """Per module, the sum over the shard dimension is halved by us, then by FSDP; after
    backward, by FSDP, then by us: the same as hybrid sharding's division by 4 (powers of 2)."""
    assert run_ranks(dense_worker, 4, tmp_path, one_exchange) == [True] * 4


def accumulation_worker(rank: int, n: int) -> dict:
    """Two micro-batches a step (FSDP reduces on the second only), gradients reduced in bf16."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)

    def run(model: nn.Module) -> list:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        for step in range(STEPS):
            for micro in range(2):
                model.set_requires_gradient_sync(micro == 1)
                model(batch(2 * step + micro, rank)).pow(2).mean().backward()
            seen.append(local_grads(model))
            optimizer.step()
            optimizer.zero_grad()
        return seen

    hybrid = run(sharded(mesh, policy))
    model = sharded(mesh["shard"], policy)
    microsparse.fsdp.sparsify(model, mesh["replicate"], density=1.0)
    dense = run(model)
    sparse = {}
    for one_exchange in (False, True):
        model = sharded(mesh["shard"], policy)
        state = microsparse.fsdp.sparsify(model, mesh["replicate"], density=0.05,
                                          one_exchange=one_exchange)  # fmt: skip
        run(model)
        sparse[one_exchange] = {
            "steps": state.step,
            "residual dtypes": {str(s.feedback.residual.dtype) for s in state._slabs.values()},
            "k": (state.last_step.selected, state.last_step.target),
        }
    return {"dense is hybrid": same(hybrid, dense), "sparse": sparse}


def test_gradient_accumulation_and_bf16_reduction(tmp_path) -> None:
    for result in run_ranks(accumulation_worker, 4, tmp_path):
        assert result["dense is hybrid"]
        for sparse in result["sparse"].values():  # per module, and after backward
            assert sparse["steps"] == STEPS  # one exchange per optimizer step, not micro-batch
            assert sparse["residual dtypes"] == {"torch.float32"}  # the residual stays float32
            assert sparse["k"][0] == sparse["k"][1]


def micro_worker(rank: int, n: int, wire: str | None) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicate = mesh.get_group("replicate")
    model = sharded(mesh["shard"])
    options = {} if wire is None else {"wire": wire}
    state = microsparse.fsdp.sparsify(model, mesh["replicate"], density=0.05, **options)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    worst, largest, selected, identical = 0.0, 0.0, [], []

    def watched(number: int, shard: torch.Tensor) -> None:  # the real hook, observed
        nonlocal worst, largest
        slab = state._slabs.get(number)
        before = shard.clone() + (0 if slab is None else slab.feedback.residual)
        state._average(number, shard)
        after = state._slabs[number].feedback.residual.clone()
        had, kept = before.clone(), after.clone()
        dist.all_reduce(had, group=replicate)
        dist.all_reduce(kept, group=replicate)
        worst = max(worst, (had - (2 * shard + kept)).abs().max().item())
        largest = max(largest, (2 * shard).abs().max().item())

    for number, unit in enumerate(units):
        unit.set_all_reduce_hook(functools.partial(watched, number))

    def each(step: int) -> None:
        selected.append((state.last_step.selected, state.last_step.target, state.step))
        params = torch.cat([p.to_local().reshape(-1) for p in model.parameters()])
        rows = [torch.empty_like(params) for _ in range(2)]
        dist.all_gather(rows, params, group=replicate)
        identical.append(torch.equal(rows[0], rows[1]))

    train(model, rank, range(STEPS), each)
    residuals = sum(s.feedback.residual.abs().sum().item() for s in state._slabs.values())
    return {"worst": worst, "largest": largest, "selected": selected, "identical": identical,
            "residual": residuals}  # fmt: skip


@pytest.mark.parametrize("wire", ["plain", None])
def test_micro_conserves_every_shard_keeps_replicas_identical_and_sends_k(wire, tmp_path) -> None:
    """float32 rounding on the plain wire; on the default compact wire each rank keeps its own
    bfloat16 rounding and only the all-reduce's one bfloat16 sum of two values rounds."""
    for result in run_ranks(micro_worker, 4, tmp_path, wire):
        if wire == "plain":
            assert result["worst"] < 1e-5
        else:
            assert 0 < result["worst"] <= 2**-8 * result["largest"] + 1e-5
        assert all(result["identical"])
        assert result["residual"] > 0  # something was held back
        # k over the whole model: each module's share adds up; no build-up across replicas
        for selected, target, _ in result["selected"]:
            assert selected == target
        assert [step for _, _, step in result["selected"]] == list(range(1, STEPS + 1))


def one_exchange_worker(rank: int, n: int) -> dict:
    """``one_exchange``: every parameter's shard averaged in one step after backward."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicate = mesh.get_group("replicate")
    model = sharded(mesh["shard"])
    state = microsparse.fsdp.sparsify(model, mesh["replicate"], density=0.05, one_exchange=True)
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    worst, largest, rounds, identical, stats = 0.0, 0.0, {}, [], []
    collective, average_model = state._collectives.run, state._average_model

    def counted(request):  # the real collectives, counted by step
        rounds[state.step] = rounds.get(state.step, 0) + 1
        return collective(request)

    def watched(record) -> None:  # the real step, observed
        nonlocal worst, largest
        slab = state._slabs.get(0)
        before = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])
        before += 0 if slab is None else slab.feedback.residual
        average_model(record)
        average = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])
        kept = state._slabs[0].feedback.residual.clone()
        dist.all_reduce(before, group=replicate)
        dist.all_reduce(kept, group=replicate)
        worst = max(worst, (before - (2 * average + kept)).abs().max().item())
        largest = max(largest, (2 * average).abs().max().item())

    state._collectives.run, state._average_model = counted, watched

    def each(step: int) -> None:
        last = state.last_step
        numel = sum(p.to_local().numel() for p in model.parameters())
        stats.append((last.selected, last.target, math.floor(0.05 * numel), last.extra["slabs"]))
        params = torch.cat([p.to_local().reshape(-1) for p in model.parameters()])
        rows = [torch.empty_like(params) for _ in range(2)]
        dist.all_gather(rows, params, group=replicate)
        identical.append(torch.equal(rows[0], rows[1]))

    train(model, rank, range(STEPS), each)
    return {"worst": worst, "largest": largest, "rounds": rounds, "identical": identical,
            "stats": stats, "units": units, "step": state.step}  # fmt: skip


def test_one_exchange_averages_the_whole_model_in_two_rounds_and_conserves(tmp_path) -> None:
    for result in run_ranks(one_exchange_worker, 4, tmp_path):
        # each rank keeps its own bfloat16 rounding of the values (the compact wire)
        assert 0 < result["worst"] <= 2**-8 * result["largest"] + 1e-5
        assert all(result["identical"]) and result["step"] == STEPS
        for selected, target, model_k, slabs in result["stats"]:
            assert selected == target == model_k and slabs == 1  # k of the model, not split
        # the options' agreement once, then the index message and the values, a step for the
        # whole model, where the exchange per module takes two for each of its 4 modules
        assert result["units"] == 4
        assert result["rounds"] == {0: 3, **{step: 2 for step in range(1, STEPS)}}


class WithUnused(nn.Module):
    """The test's net, and a layer no forward pass uses."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.spare = net(), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def unused_worker(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = WithUnused()
    model.body[0].bias.requires_grad_(False)  # frozen: not averaged, no room in the residual
    for module in [*model.body, model.spare]:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    state = microsparse.fsdp.sparsify(model, mesh["replicate"], 0.05, one_exchange=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    replicate, identical = mesh.get_group("replicate"), []
    for step in range(STEPS):
        optimizer.zero_grad()
        model(batch(step, rank)).pow(2).mean().backward()
        optimizer.step()
        params = torch.cat([p.to_local().reshape(-1) for p in model.parameters()])
        rows = [torch.empty_like(params) for _ in range(2)]
        dist.all_gather(rows, params, group=replicate)
        identical.append(torch.equal(rows[0], rows[1]))
    spare = [p.grad for p in model.spare.parameters()]
    used = sum(p.to_local().numel() for p in model.body.parameters() if p.requires_grad)
    residual = state._slabs[0].feedback.residual
    trained = sum(p.to_local().numel() for p in model.parameters() if p.requires_grad)
    return {"spare grads": spare, "identical": identical, "step": state.step,
            "residual size": (residual.numel(), trained),
            "spare residual": residual[used:].abs().sum().item(),
            "used residual": residual[:used].abs().sum().item()}  # fmt: skip


def test_one_exchange_leaves_an_unused_layer_as_fsdp_does(tmp_path) -> None:
    """Its gradient stays None (so the optimiser skips it, as with FSDP alone), nothing of it
    is proposed, and its residual stays empty; a frozen parameter has no residual at all."""
    for result in run_ranks(unused_worker, 4, tmp_path):
        assert result["spare grads"] == [None, None]
        assert all(result["identical"]) and result["step"] == STEPS
        assert result["spare residual"] == 0 and result["used residual"] > 0
        assert result["residual size"][0] == result["residual size"][1]


CORRECTIONS = [
    {"momentum_correction": 0.9},
    {"momentum_correction": 0.9, "momentum_nesterov": True, "density_warmup": (0.15, 2)},
    {"adam_correction": (0.5, 0.9, 1e-8)},
]


def corrected(options: dict, g: torch.Tensor, memory: list[torch.Tensor], step: int) -> tuple:
    """The reference, in float64: what the residual accumulates at ``step`` and the velocity
    (momentum correction) or Adam's moments after it, before any masking."""
    if "adam_correction" in options:
        beta1, beta2, eps = options["adam_correction"]
        m, v = beta1 * memory[0] + (1 - beta1) * g, beta2 * memory[1] + (1 - beta2) * g * g
        t = step + 1
        return (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps), [m, v]
    momentum = options["momentum_correction"]
    u = momentum * memory[0] + g
    return (g + momentum * u if options.get("momentum_nesterov") else u), [u]


def corrections_worker(rank: int, n: int) -> list[dict]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return [corrections_case(rank, mesh, options) for options in CORRECTIONS]


def corrections_case(rank: int, mesh, options: dict) -> dict:
    """One correction on every module's shard against the reference, hook call by hook call:
    the replicas' accumulated vectors add up to what was averaged plus what stayed behind, the
    residual is zero where a value was sent and the accumulated vector elsewhere, the velocity
    is masked where a value was sent, Adam's moments are not, and K == k at every step."""
    replicate = mesh.get_group("replicate")
    model = sharded(mesh["shard"])
    # the plain wire: the residual is 0 where sent (the compact one keeps bfloat16's rounding)
    state = microsparse.fsdp.sparsify(model, mesh["replicate"], density=0.05, wire="plain",
                                      **options)  # fmt: skip
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    worst = {"conservation": 0.0, "residual": 0.0, "memory": 0.0}
    sent_per_step = [0] * STEPS

    def note(name: str, error: torch.Tensor, of: torch.Tensor) -> None:
        """The largest error relative to the vector's scale (the package computes in float32)."""
        worst[name] = max(worst[name], error.abs().max().item() / (1 + of.abs().max().item()))

    def watched(number: int, shard: torch.Tensor) -> None:
        slab = state._slabs.get(number)
        g = shard.double().clone()
        before = None if slab is None else [b.data.double() for b in slab.feedback.buffers]
        step = state.step
        state._average(number, shard)
        after = [b.data.double() for b in state._slabs[number].feedback.buffers]
        before = before or [torch.zeros_like(g) for _ in after]
        increment, moved = corrected(options, g, before[1:], step)
        accumulated = before[0] + increment
        average = shard.double()
        sent = average != 0  # the union of every replica's selection
        had, kept = accumulated.clone(), after[0].clone()
        dist.all_reduce(had, group=replicate)
        dist.all_reduce(kept, group=replicate)
        note("conservation", had - (2 * average + kept), accumulated)
        note("residual", after[0].where(sent, after[0] - accumulated), accumulated)
        if "momentum_correction" in options:  # momentum factor masking
            moved = [moved[0].where(~sent, 0)]
        for got, want in zip(after[1:], moved):
            note("memory", got - want, want)
        sent_per_step[step] += int(sent.sum())

    for number, unit in enumerate(units):
        unit.set_all_reduce_hook(functools.partial(watched, number))
    targets = []
    train(model, rank, range(STEPS), lambda step: targets.append(state.last_step.target))
    start, steps = options.get("density_warmup", (0.05, 0))
    schedule = [start * (0.05 / start) ** (t / steps) if t < steps else 0.05 for t in range(STEPS)]
    numel = state.last_step.numel
    return {**worst, "sent": sent_per_step, "targets": targets,
            "expected": [math.floor(d * numel) for d in schedule],
            "described": state.described()}  # fmt: skip


def test_momentum_and_adam_correction_and_the_warmup_match_the_reference(tmp_path) -> None:
    for ranks in run_ranks(corrections_worker, 4, tmp_path):
        for options, result in zip(CORRECTIONS, ranks):
            assert result["conservation"] < 1e-6, (options, result)
            assert result["residual"] < 1e-6, (options, result)
            assert result["memory"] < 1e-6, (options, result)
            # K == k over the model at every step; under the warm-up, k follows its schedule
            assert result["sent"] == result["targets"] == result["expected"], (options, result)
            for name in set(options) - {"momentum_nesterov"}:  # nesterov: in momentum's entry
                assert name in result["described"]
    warmup = ranks[1]["expected"]
    assert warmup[0] > warmup[1] > warmup[2] == ranks[0]["expected"][2]


RESUMED = [  # each saved after 2 steps, the warm-up's 3 not over then
    {},
    {"momentum_correction": 0.9, "momentum_nesterov": True, "density_warmup": (0.2, 3)},
    {"adam_correction": (0.5, 0.9, 1e-8)},
    {"one_exchange": True, "momentum_correction": 0.9},
]


def resume_worker(rank: int, n: int, folder: str) -> dict:
    """Model and states through torch.distributed.checkpoint, each rank's state its own."""
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def fresh(shape=mesh, **options) -> tuple[nn.Module, microsparse.fsdp.ShardedState]:
        model = sharded(shape["shard"])
        return model, microsparse.fsdp.sparsify(model, shape["replicate"], 0.05, **options)

    exact = []
    for case, options in enumerate(RESUMED):
        model, state = fresh(**options)
        train(model, rank, range(2))
        dcp.save({"model": model.state_dict(), "sparse": microsparse.OwnRank(state)},
                 checkpoint_id=f"{folder}/{case}")  # fmt: skip
        straight = train(model, rank, range(2, 4))

        model, state = fresh(**options)
        dcp.load({"model": model.state_dict(), "sparse": microsparse.OwnRank(state)},
                 checkpoint_id=f"{folder}/{case}")  # fmt: skip
        resumed = train(model, rank, range(2, 4))
        exact.append(state.step == 4 and same(straight, resumed))

    refused = []
    # Another mesh shape, the same ranks: 4 replicas of one shard each.
    other = init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard"))
    # The corrections saved, none here: the velocity would be dropped without a word.
    # Saved after backward, restored per module: the residuals would be cut differently.
    for (_, state), case in [(fresh(other), 0), (fresh(), 1), (fresh(), 3)]:
        try:
            dcp.load({"sparse": microsparse.OwnRank(state)}, checkpoint_id=f"{folder}/{case}")
            refused.append("no error")
        except ValueError as error:
            refused.append(str(error))
    return {"exact": exact, "refused": refused}


def test_a_resumed_run_continues_bit_for_bit_through_dcp(tmp_path) -> None:
    for result in run_ranks(resume_worker, 4, tmp_path, str(tmp_path / "checkpoint")):
        assert result["exact"] == [True] * len(RESUMED)  # the velocity and moments too
        other_mesh, without_corrections, per_module = result["refused"]
        assert "saved with other options" in other_mesh
        assert "shard (this rank's place, shard size)" in other_mesh
        assert "momentum_correction [0.9, True] there, '(not set)' here" in without_corrections
        assert "density_warmup [0.2, 3] there" in without_corrections
        assert "one_exchange True there, '(not set)' here" in per_module


BAD_CORRECTIONS = [  # (the arguments, what the error must say)
    ({"density": 1.0, "momentum_correction": 0.9},
     "momentum_correction needs error feedback, but this state averages densely"),
    ({"density": 0.01, "sparsifier": "dense", "adam_correction": (0.9, 0.999, 1e-8)},
     "leave adam_correction unset and keep the optimiser's Adam"),
    ({"density": 0.01, "momentum_correction": 0.9, "adam_correction": (0.9, 0.999, 1e-8)},
     "replaces momentum correction: use it without momentum_correction"),
    ({"density": 0.01, "momentum_correction": 1.0}, "momentum_correction must be in [0, 1)"),
    ({"density": 0.01, "adam_correction": (0.9, 0.99)},
     "adam_correction must be (beta1, beta2, eps), e.g. (0.9, 0.999, 1e-8)"),
    ({"density": 0.01, "density_warmup": (0.005, 10)},
     "density_warmup: the start density (0.005) must be above the density (0.01)"),
    ({"density": 1.0, "density_warmup": (0.5, 10)},
     "density_warmup needs a sparsifier that selects"),
    ({"density": 0.01, "density_warmup": (0.1, 0)},
     "density_warmup: the steps must be a whole number >= 1"),
    ({"density": 0.01, "adam_correction": (0.9, 0.999, 1e-8),
      "grad_scaler": torch.amp.GradScaler("cpu")},
     "adam_correction keeps Adam's moments of unscaled gradients"),
]  # fmt: skip


def loose(mesh) -> nn.Module:
    """The layers sharded, the model (which holds a parameter of its own) not."""
    model = net()
    model.register_parameter("scale", nn.Parameter(torch.ones(1)))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return model


def refusal_worker(rank: int, n: int) -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    messages = []
    attempts = [
        lambda: microsparse.fsdp.sparsify(net(), mesh["replicate"], density=0.01),
        lambda: microsparse.fsdp.sparsify(sharded(mesh), mesh["replicate"], density=0.01),
        lambda: microsparse.fsdp.sparsify(sharded(mesh["shard"]), mesh, density=0.01),
        lambda: microsparse.fsdp.sparsify(sharded(mesh["shard"]), mesh["replicate"], 0.01,
                                          selction="threshold"),  # fmt: skip
        lambda: microsparse.fsdp.sparsify(loose(mesh["shard"]), mesh["replicate"], 0.01),
    ]
    attempts += [
        functools.partial(
            microsparse.fsdp.sparsify, sharded(mesh["shard"]), mesh["replicate"], **arguments
        )
        for arguments, _ in BAD_CORRECTIONS
    ]
    for attempt in attempts:
        try:
            attempt()
            messages.append("no error")
        except (TypeError, ValueError) as error:
            messages.append(str(error))
    # Replicas that disagree on a correction: named, with each one's value.
    model = sharded(mesh["shard"])
    momentum = 0.9 if rank < 2 else 0.5  # the replicas of each shard: ranks 0, 2 and 1, 3
    microsparse.fsdp.sparsify(model, mesh["replicate"], 0.01, momentum_correction=momentum)
    try:
        model(batch(0, rank)).sum().backward()
        messages.append("no error")
    except microsparse.ConfigMismatchError as error:
        messages.append(str(error))
    # The shard dimension given as the replicate one: ranks holding other shards disagree.
    model = sharded(mesh["shard"])
    microsparse.fsdp.sparsify(model, mesh["shard"], density=0.01)
    try:
        model(batch(0, rank)).sum().backward()
        messages.append("no error")
    except microsparse.ConfigMismatchError as error:
        messages.append(str(error))
    return messages


def test_bad_input_is_refused_on_every_rank_with_the_fix(tmp_path) -> None:
    for messages in run_ranks(refusal_worker, 4, tmp_path):
        plain, hybrid, two_d, misspelt, unsharded, *corrections, disagree, wrong_group = messages
        for (_, expected), message in zip(BAD_CORRECTIONS, corrections, strict=True):
            assert expected in message, message
        assert "momentum_correction (rank 0: [0.9, False], rank 1: [0.5, False])" in disagree
        assert "none of its modules is sharded by FSDP2; call fully_shard" in plain
        assert "a 2-D mesh (hybrid sharding)" in hybrid and "mesh['shard']" in hybrid
        assert "replicate must be one dimension of the mesh" in two_d
        assert "'selction'" in misspelt and "selection" in misspelt
        assert "1 of its parameters (scale, ...) are not sharded by FSDP2" in unsharded
        assert "fully_shard(model, mesh=mesh['shard']) on the model itself" in unsharded
        assert "mesh['replicate']" in wrong_group and "shard (this rank's place" in wrong_group


def scaler_worker(rank: int, n: int, one_exchange: bool) -> dict:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    plain = sharded(mesh["shard"])  # the same steps without a scaler, to compare with
    unscaled = microsparse.fsdp.sparsify(plain, mesh["replicate"], 0.05,
                                         one_exchange=one_exchange)  # fmt: skip
    plain_residuals = []
    train(plain, rank, range(4), lambda step: plain_residuals.append(
        [s.feedback.residual.clone() for s in unscaled._slabs.values()]))
    model = sharded(mesh["shard"])
    scaler = ShardedGradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    state = microsparse.fsdp.sparsify(model, mesh["replicate"], 0.05, grad_scaler=scaler,
                                      one_exchange=one_exchange)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scales, moved, residuals = [], [], []
    for step in range(8):
        optimizer.zero_grad()
        x = batch(step, rank)
        if step == 4 and rank == 3:
            x *= 3e37  # the scaled loss overflows on one rank of one replica only
        before = [p.to_local().detach().clone() for p in model.parameters()]
        scaler.scale(model(x).pow(2).mean()).backward()
        residuals.append([s.feedback.residual.clone() for s in state._slabs.values()])
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        now = [p.to_local() for p in model.parameters()]
        moved.append(any(not torch.equal(a, b) for a, b in zip(before, now)))
    return {"scales": scales, "moved": moved, "residuals": residuals,
            "plain_residuals": plain_residuals,
            "params": [p.to_local().detach().clone() for p in model.parameters()]}  # fmt: skip


@pytest.mark.parametrize("one_exchange", [False, True])
def test_a_grad_scaler_overflow_is_skipped_everywhere_and_training_goes_on(
    one_exchange, tmp_path
) -> None:
    results = run_ranks(scaler_worker, 4, tmp_path, one_exchange)
    for result in results:
        assert result["moved"][4] is False  # the overflowing step changed nothing, anywhere
        assert all(result["moved"][:4]) and all(result["moved"][5:])
        assert result["scales"][4] == result["scales"][3] / 2  # the scaler backed off
        # The skipped step kept every residual as it was, and none holds a NaN or Inf.
        assert same([result["residuals"][3]], [result["residuals"][4]])
        assert all(torch.isfinite(r).all() for step in result["residuals"] for r in step)
        # A power-of-two scale is exact: the residuals hold the unscaled run's, bit for bit.
        assert same(result["residuals"][:4], result["plain_residuals"])
    assert all(result["scales"] == results[0]["scales"] for result in results)
    for shard in (0, 1):  # ranks 0 and 2 hold shard 0 in each replica, 1 and 3 shard 1
        first, second = results[shard], results[shard + 2]
        assert same([first["params"]], [second["params"]])
