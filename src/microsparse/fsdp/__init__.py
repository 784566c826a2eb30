"""Sparse gradient averaging across the replicas of sharded training (FSDP2 ``fully_shard``).

Hybrid sharding keeps a full copy of the model on each *replica* (a node, say) and shards it
inside: gradients are reduce-scattered over the fast links of the shard dimension, then
all-reduced across replicas over the slow network. :func:`sparsify` replaces that last hop by
the project's sparse step (MiCRO by default): each rank averages its own gradient shard with
the ranks that hold the same shard in the other replicas, sending a fraction of it and keeping
the rest in a residual the size of the shard. Shard the model over the shard dimension only and
let :func:`sparsify` average across the other::

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = microsparse.fsdp.sparsify(model, mesh["replicate"], density=0.001)

The exchange runs inside FSDP's all-reduce hook (``FSDPModule.set_all_reduce_hook``), once per
FSDP module per backward pass, overlapped with the rest of backward, without the host waiting
for the device (MiCRO's default). See :class:`ShardedState`.
"""

from microsparse.fsdp.state import ShardedState, sparsify

__all__ = ["ShardedState", "sparsify"]
