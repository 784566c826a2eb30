"""Attach a method to a model: microsparse's DDP hook, torch's peer hooks, or none."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from microsparse.ddp import SparseState, sparse_hook
from microsparse_lab.methods.names import Method
from microsparse_lab.methods.powersgd import PowerSGD
from microsparse_lab.methods.traffic import ONE_BUCKET_BYTES


def attach_method(
    method: Method, model: nn.Module, density: float, start: int, checkpointable: bool = False
) -> tuple[nn.Module, Any]:
    """Wrap ``model`` for a DDP method and register its hook; returns (module to train, the
    hook's state or None). ``start`` is the step from which PowerSGD compresses, unless the
    name sets its own. ``checkpointable`` runs torch's PowerSGD hook through
    :class:`~microsparse_lab.methods.powersgd.PowerSGD`, whose state a checkpoint can save and
    restore; the benchmarks leave it off to time torch's hook as users get it."""
    # Else DDP's own bucket defaults (1 MiB first, 25 MiB after), as a user gets them.
    one_bucket_mb = ONE_BUCKET_BYTES >> 20
    ddp = DistributedDataParallel(model, bucket_cap_mb=one_bucket_mb if method.one_bucket else None)
    state: Any = None
    if method.kind == "floor":
        ddp.register_comm_hook(None, unchanged_hook)
    elif method.kind == "hook":
        state = SparseState(method.sparsifier, **method.amount(density), **method.value_options(),
                            one_exchange=method.one_exchange, min_speedup=method.min_speedup,
                            **method.options)  # fmt: skip
        ddp.register_comm_hook(state, sparse_hook)
    elif method.sparsifier == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method.sparsifier == "bf16":
        ddp.register_comm_hook(None, bfloat16_hook)
    elif method.sparsifier == "powersgd" and checkpointable:
        state = PowerSGD(model.parameters(), method.rank, method.compresses_from(start))
        state.attach(ddp)
    elif method.sparsifier == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=method.rank,
            start_powerSGD_iter=method.compresses_from(start), use_error_feedback=True,
            warm_start=True,
        )  # fmt: skip
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    return ddp, state


def unchanged_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """Hand the bucket back as it is: DDP's own cost, no exchange (``none@ddp``)."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def bfloat16_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """torch's ``bf16_compress_hook`` body: divide, cast to bfloat16, all-reduce, cast back
    into the bucket. DDP refuses a hook of torch's name without CUDA (it checks the name); the
    same body under another name runs on CPU. (Unannotated: DDP checks a hook's annotations as
    objects, and this module's are strings.)"""
    buffer = bucket.buffer()
    world_size = dist.get_world_size(process_group)
    compressed = buffer.div(world_size).to(torch.bfloat16)
    work = dist.all_reduce(compressed, group=process_group, async_op=True)

    def decompress(future):  # type: ignore[no-untyped-def]
        buffer.copy_(future.value()[0])
        return buffer

    return work.get_future().then(decompress)
