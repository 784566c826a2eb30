"""``train --integration fsdp``: the task's model sharded by FSDP2, replicas averaged sparsely.

The ranks form a 2-D mesh, (replicas, shards): the ranks of one replica shard the model among
them (``fully_shard`` over the mesh's shard dimension: every child module that holds
parameters, then the model), and the replicas average each gradient shard across the replicate
dimension with :func:`microsparse.fsdp.sparsify`. With ``--sparsifier dense`` the model is
sharded over the 2-D mesh instead: FSDP2's own hybrid sharding, what a user would otherwise run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import microsparse.fsdp
from microsparse.comm import all_reduce_bytes
from microsparse.engine import dense_stats
from microsparse.fsdp import ShardedState
from microsparse.stats import StepStats
from microsparse_lab.training.config import shards_per_replica


def mesh_of(shards: int | None, device: torch.device) -> DeviceMesh:
    """The (replicate, shard) mesh: ``shards`` ranks per replica (default: per machine)."""
    world = dist.get_world_size()
    shards = shards_per_replica(shards)
    if world % shards:
        raise ValueError(
            f"shards: {shards} ranks per replica do not divide the {world} ranks; pass "
            "--shards with a divisor of the number of ranks"
        )
    return init_device_mesh(device.type, (world // shards, shards),
                            mesh_dim_names=("replicate", "shard"))  # fmt: skip


def mesh_shape(mesh: DeviceMesh) -> dict[str, int]:
    """``{"replicate": replicas, "shard": ranks per replica}``: what a checkpoint records, as
    a resumed run must shard the model alike."""
    return {name: mesh[name].size() for name in ("replicate", "shard")}


def shard(model: nn.Module, mesh: DeviceMesh) -> None:
    """``fully_shard`` every child that holds parameters, then the model, over ``mesh``.

    A child that shares a parameter with another (tied embeddings) stays in the model's
    group: FSDP2 manages a parameter in one group only.
    """
    children = [c for c in model.children() if any(p.requires_grad for p in c.parameters())]
    owners: dict[int, int] = {}
    for child in children:
        for p in child.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    for child in children:
        if all(owners[id(p)] == 1 for p in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if dist.get_backend() == "gloo":  # gloo has no ReduceOp.AVG
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.set_force_sum_reduction_for_comms(True)


class HybridSharding:
    """FSDP2's hybrid sharding (a 2-D mesh), reporting every entry averaged (the peers'
    interface: ``step()`` after each backward pass, a step count to checkpoint)."""

    name = "hybrid sharding"

    def __init__(self, model: nn.Module, mesh: DeviceMesh) -> None:
        shard(model, mesh)
        self._numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self._replicas = mesh["replicate"].size()
        # Bytes between replicas: each rank all-reduces its shard (float32) across them.
        self._bytes = all_reduce_bytes(4 * self._numel // mesh["shard"].size(), self._replicas)
        self.steps = 0

    def step(self) -> StepStats:
        d, n, sent = self._numel, self._replicas, self._bytes
        stats = dense_stats(self.steps, d, n, target=d, bytes_sent=sent, dense_bytes=sent)
        self.steps += 1
        return stats

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = int(state["steps"])


def sharded(
    model: nn.Module, mesh: DeviceMesh, sparsifier: str, **options
) -> ShardedState | HybridSharding:
    """Shard ``model`` in place over ``mesh`` (:func:`mesh_of`) and attach its averaging
    across replicas."""
    if sparsifier == "dense":
        return HybridSharding(model, mesh)
    shard(model, mesh["shard"])
    return microsparse.fsdp.sparsify(model, mesh["replicate"], sparsifier=sparsifier, **options)
