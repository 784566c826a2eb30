"""microsparse.fsdp on real FSDP2: 4 gloo ranks as 2 replicas × 2 shards.

Against hybrid sharding itself (density 1 gives its gradients bit for bit), against the
invariants of error feedback per shard (what every replica had, gradient plus residual, is
what was averaged plus what stayed behind), replicas identical after every step, exactly k
entries a step over the whole model, exact resume, and bad input refused on every rank.
"""

from __future__ import annotations

import functools

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


def dense_worker(rank: int, n: int) -> bool:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hybrid = train(sharded(mesh), rank, range(STEPS))
    model = sharded(mesh["shard"])
    microsparse.fsdp.sparsify(model, mesh["replicate"], density=1.0)
    return same(hybrid, train(model, rank, range(STEPS)))


def test_density_one_is_hybrid_sharding_bit_for_bit(tmp_path) -> None:
    assert run_ranks(dense_worker, 4, tmp_path) == [True] * 4


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
    model = sharded(mesh["shard"], policy)
    state = microsparse.fsdp.sparsify(model, mesh["replicate"], density=0.05)
    run(model)
    return {
        "dense is hybrid": same(hybrid, dense),
        "steps": state.step,
        "residual dtypes": {str(s.feedback.residual.dtype) for s in state._slabs.values()},
        "k": (state.last_step.selected, state.last_step.target),
    }


def test_gradient_accumulation_and_bf16_reduction(tmp_path) -> None:
    for result in run_ranks(accumulation_worker, 4, tmp_path):
        assert result["dense is hybrid"]
        assert result["steps"] == STEPS  # one exchange per optimizer step, not per micro-batch
        assert result["residual dtypes"] == {"torch.float32"}  # the residual stays float32
        assert result["k"][0] == result["k"][1]


def micro_worker(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicate = mesh.get_group("replicate")
    model = sharded(mesh["shard"])
    state = microsparse.fsdp.sparsify(model, mesh["replicate"], density=0.05)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    worst, selected, identical = 0.0, [], []

    def watched(number: int, shard: torch.Tensor) -> None:  # the real hook, observed
        nonlocal worst
        slab = state._slabs.get(number)
        before = shard.clone() + (0 if slab is None else slab.feedback.residual)
        state._average(number, shard)
        after = state._slabs[number].feedback.residual.clone()
        had, kept = before.clone(), after.clone()
        dist.all_reduce(had, group=replicate)
        dist.all_reduce(kept, group=replicate)
        worst = max(worst, (had - (2 * shard + kept)).abs().max().item())

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
    return {"worst": worst, "selected": selected, "identical": identical, "residual": residuals}


def test_micro_conserves_every_shard_keeps_replicas_identical_and_sends_k(tmp_path) -> None:
    for result in run_ranks(micro_worker, 4, tmp_path):
        assert result["worst"] < 1e-5
        assert all(result["identical"])
        assert result["residual"] > 0  # something was held back
        # k over the whole model: each module's share adds up; no build-up across replicas
        for selected, target, _ in result["selected"]:
            assert selected == target
        assert [step for _, _, step in result["selected"]] == list(range(1, STEPS + 1))


def resume_worker(rank: int, n: int, folder: str) -> dict:
    """Model and states through torch.distributed.checkpoint, each rank's state its own."""
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def fresh(shape=mesh) -> tuple[nn.Module, microsparse.fsdp.ShardedState]:
        model = sharded(shape["shard"])
        return model, microsparse.fsdp.sparsify(model, shape["replicate"], density=0.05)

    model, state = fresh()
    train(model, rank, range(2))
    dcp.save({"model": model.state_dict(), "sparse": microsparse.OwnRank(state)},
             checkpoint_id=folder)  # fmt: skip
    straight = train(model, rank, range(2, 4))

    model, state = fresh()
    dcp.load({"model": model.state_dict(), "sparse": microsparse.OwnRank(state)},
             checkpoint_id=folder)  # fmt: skip
    resumed = train(model, rank, range(2, 4))
    steps = state.step

    # Another mesh shape, the same ranks: 4 replicas of one shard each.
    other = init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard"))
    model, state = fresh(other)
    try:
        dcp.load({"sparse": microsparse.OwnRank(state)}, checkpoint_id=folder)
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    return {"exact": steps == 4 and same(straight, resumed), "refused": refused}


def test_a_resumed_run_continues_bit_for_bit_through_dcp(tmp_path) -> None:
    for result in run_ranks(resume_worker, 4, tmp_path, str(tmp_path / "checkpoint")):
        assert result["exact"]
        assert "saved with other options" in result["refused"]
        assert "shard (this rank's place, shard size)" in result["refused"]


def refusal_worker(rank: int, n: int) -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    messages = []
    attempts = [
        lambda: microsparse.fsdp.sparsify(net(), mesh["replicate"], density=0.01),
        lambda: microsparse.fsdp.sparsify(sharded(mesh), mesh["replicate"], density=0.01),
        lambda: microsparse.fsdp.sparsify(sharded(mesh["shard"]), mesh, density=0.01),
        lambda: microsparse.fsdp.sparsify(sharded(mesh["shard"]), mesh["replicate"], 0.01,
                                          selction="threshold"),  # fmt: skip
    ]
    for attempt in attempts:
        try:
            attempt()
            messages.append("no error")
        except (TypeError, ValueError) as error:
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
        plain, hybrid, two_d, misspelt, wrong_group = messages
        assert "none of its modules is sharded by FSDP2; call fully_shard" in plain
        assert "a 2-D mesh (hybrid sharding)" in hybrid and "mesh['shard']" in hybrid
        assert "replicate must be one dimension of the mesh" in two_d
        assert "'selction'" in misspelt and "selection" in misspelt
        assert "mesh['replicate']" in wrong_group and "shard (this rank's place" in wrong_group
