"""The averaging methods whose training step is timed: DDP and its hooks, the loop API,
FSDP2's hybrid sharding and ``microsparse.fsdp``.

Each method wraps a fresh model into an :class:`Averaging`: the module to run forward on,
what to run between ``backward()`` and ``optimizer.step()``, and the density it sent
(read once, after timing: reading statistics may wait for the GPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import microsparse
import microsparse.ddp
import microsparse.fsdp

DENSITY = 0.001
STOCK = "stock DDP"
MICRO = "micro_hook"
ALL_REDUCE_LOOP = "all-reduce loop"
HYBRID = "FSDP2 hybrid sharding"
LARGE_BUCKETS_MB = 100
"""DDP's ``bucket_cap_mb`` in the row that gives the hook fewer, larger buckets (DDP's
default is 25)."""


@dataclass
class Averaging:
    """How one method averages a model's gradients."""

    module: nn.Module
    after_backward: Callable[[], Any] = lambda: None
    stats: Callable[[], Any] = lambda: None
    """The method's statistics of its last step (``None`` for torch's own)."""


@dataclass(frozen=True)
class Method:
    """An averaging method, and the method its step time is compared with."""

    label: str
    attach: Callable[[nn.Module, torch.device], Averaging]
    baseline: str = STOCK


def _ddp(model: nn.Module, device: torch.device,
         bucket_cap_mb: float | None = None) -> nn.parallel.DistributedDataParallel:  # fmt: skip
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb)


def _hooked(state_of: Callable[[], Any], hook: Callable[..., Any],
            bucket_cap_mb: float | None = None) -> Callable[..., Averaging]:  # fmt: skip
    """A DDP method with ``hook`` and a fresh ``state_of()`` registered; DDP's buckets of
    ``bucket_cap_mb`` (None: DDP's default, 25)."""

    def attach(model: nn.Module, device: torch.device) -> Averaging:
        ddp = _ddp(model, device, bucket_cap_mb)
        state = state_of()
        ddp.register_comm_hook(state, hook)
        return Averaging(ddp, stats=lambda: getattr(state, "last_step", None))

    return attach


def _stock(model: nn.Module, device: torch.device) -> Averaging:
    return Averaging(_ddp(model, device))


def _all_reduce_loop(model: nn.Module, device: torch.device) -> Averaging:
    """What a user of a plain loop would otherwise write: all-reduce every gradient."""
    params = [p for p in model.parameters() if p.requires_grad]
    world_size = dist.get_world_size()

    def average() -> None:
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)

    return Averaging(model, average)


def _loop_api(model: nn.Module, device: torch.device) -> Averaging:
    reducer = microsparse.GradientReducer(model.named_parameters(), "micro", DENSITY)
    return Averaging(model, reducer.synchronize, lambda: reducer.last_step)


def _mesh(device: torch.device) -> Any:
    """(replicate, shard): every rank a replica of its own (1 × 1 at world size 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(), 1),
                            mesh_dim_names=("replicate", "shard"))  # fmt: skip


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The outermost repeated blocks, each element of a ``ModuleList`` or ``Sequential``
    that holds parameters: a transformer's layers, a ResNet's bottlenecks, the layers of a
    model that is itself a ``Sequential``."""
    if isinstance(module, nn.ModuleList | nn.Sequential):
        return [block for block in module if any(True for _ in block.parameters())]
    return [block for child in module.children() for block in _blocks(child)]


def fully_shard_blocks(model: nn.Module, mesh: Any) -> None:
    """FSDP2 as users apply it: ``fully_shard`` each block, then the model (which keeps
    the rest, tied weights among them); sum reductions on gloo, which has no average."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if dist.get_backend() == "gloo":
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.set_force_sum_reduction_for_comms(True)


def _hybrid(model: nn.Module, device: torch.device) -> Averaging:
    """FSDP2's own hybrid sharding over the 2-D mesh: what a user of FSDP2 would run."""
    fully_shard_blocks(model, _mesh(device))
    return Averaging(model)


def _sparse_fsdp(model: nn.Module, device: torch.device, **options: Any) -> Averaging:
    """FSDP2 over the shard dimension, ``microsparse.fsdp`` across the replicate dimension."""
    mesh = _mesh(device)
    fully_shard_blocks(model, mesh["shard"])
    state = microsparse.fsdp.sparsify(model, mesh["replicate"], density=DENSITY, **options)
    return Averaging(model, stats=lambda: state.last_step)


def _bf16_compress(state, bucket):  # unannotated: DDP rejects annotations given as strings
    """torch's ``bf16_compress_hook`` under another name: DDP accepts that one by name only
    on NCCL, and the CPU dry run has gloo (which all-reduces bfloat16 too)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def methods(device: torch.device) -> list[Method]:
    """Every method, each baseline before the methods compared with it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    def power_sgd() -> Any:
        return powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                           start_powerSGD_iter=2)  # fmt: skip

    ddp = microsparse.ddp
    bf16 = default_hooks.bf16_compress_hook if device.type == "cuda" else _bf16_compress
    return [
        Method(STOCK, _stock),
        Method(MICRO, _hooked(lambda: ddp.MicroState(density=DENSITY), ddp.micro_hook)),
        # The default on a GPU starts each bucket's step on the hook's own thread; here not.
        Method("micro_hook, on autograd's thread", _hooked(
            lambda: ddp.MicroState(density=DENSITY, own_thread=False), ddp.micro_hook)),
        Method("micro_hook one_exchange", _hooked(
            lambda: ddp.MicroState(density=DENSITY, one_exchange=True), ddp.micro_hook)),
        # Fewer, larger buckets: each bucket's step has a fixed cost (its rounds, its kernels).
        Method(f"micro_hook, {LARGE_BUCKETS_MB} MB buckets", _hooked(
            lambda: ddp.MicroState(density=DENSITY), ddp.micro_hook, LARGE_BUCKETS_MB)),
        # Sharded training before the rest, so that a run short of time still measures it.
        Method(HYBRID, _hybrid, baseline=HYBRID),
        Method("microsparse.fsdp micro", _sparse_fsdp, baseline=HYBRID),
        Method("microsparse.fsdp micro, one_exchange",
               functools.partial(_sparse_fsdp, one_exchange=True), baseline=HYBRID),
        # bfloat16 values (the default beyond 16 ranks): 8 fewer small kernels a bucket than
        # the default's 8-bit ones, which share a scale in the index message.
        Method("micro_hook, bfloat16 values", _hooked(
            lambda: ddp.MicroState(density=DENSITY, value_dtype=torch.bfloat16), ddp.micro_hook)),
        Method("sparse_hook topk", _hooked(lambda: ddp.SparseState("topk", DENSITY),
                                           ddp.sparse_hook)),
        # The union as n·k fixed slots: no host sync, the values' bytes at their worst.
        Method("sparse_hook topk, fixed wire", _hooked(
            lambda: ddp.SparseState("topk", DENSITY, wire="fixed"), ddp.sparse_hook)),
        Method("fp16_compress_hook", _hooked(lambda: None, default_hooks.fp16_compress_hook)),
        Method("bf16_compress_hook", _hooked(lambda: None, bf16)),
        Method("PowerSGD rank 4", _hooked(power_sgd, powerSGD_hook.powerSGD_hook)),
        Method(ALL_REDUCE_LOOP, _all_reduce_loop, baseline=ALL_REDUCE_LOOP),
        Method("GradientReducer micro", _loop_api, baseline=ALL_REDUCE_LOOP),
    ]  # fmt: skip
