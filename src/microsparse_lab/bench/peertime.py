"""What torch's PowerSGD hook adds to DDP's backward pass, timed end to end on one rank.

The α–β model knows PowerSGD's bytes and collectives from the layer shapes; the hook's own
work on this machine it must measure. Timing only the matrix products (M·Q, the
orthogonalisation, Mᵀ·P, P·Qᵀ) left most of it out: the hook's passes over the whole bucket
(the error feedback added in and the new residual kept, the uncompressed tensors copied out
and back, every compressed matrix copied into the contiguous P and Q and out again). On
ResNet-18 the products alone were 0.45–0.6 of what the hook adds.

So the hook is timed as users run it: torch's ``powerSGD_hook`` with the state
``microsparse bench cluster`` gives it (error feedback, warm start, one bucket holding the
model) on a one-rank gloo group, where its all-reduces have nothing to move, against DDP
with a hook that hands the bucket back (``none@ddp``) on the same parameters, pass by pass
in turn, after DDP's bucket rebuild and once compression has started; the difference of the
medians. It runs in a child process pinned to ``threads`` cores, so that neither gloo's
threads nor other work borrow a core the measurement does not own, and so that the caller's
process keeps no process group.

Example:
    >>> timing = powersgd_seconds([(256, 128), (256,)], rank=1, passes=3)
    >>> timing.seconds >= 0, timing.sent  # P and Q: 256 + 128 entries; the bias raw: 256
    (True, 640)
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
from torch import nn

from microsparse_lab.methods.hooks import attach_method, unchanged_hook
from microsparse_lab.methods.names import parse_method
from microsparse_lab.methods.traffic import ONE_BUCKET_BYTES
from microsparse_lab.training.launch import leave_process

WARMUP = 3
"""Untimed passes: DDP rebuilds its buckets after the first, PowerSGD compresses from the third."""
START = 2
"""PowerSGD's ``start_powerSGD_iter``, as ``bench cluster`` runs it."""


@dataclass(frozen=True)
class HookTiming:
    """Median seconds the hook adds to one backward pass, and the entries it all-reduced per
    compressed pass by torch's own count (``PowerSGDState.compression_stats``)."""

    seconds: float
    sent: int


def powersgd_seconds(
    shapes: Sequence[Sequence[int]],
    rank: int,
    threads: int = 1,
    passes: int = 5,
    timeout: float = 600.0,
) -> HookTiming:
    """Time torch's ``powerSGD_hook`` at matrix rank ``rank`` on gradients of ``shapes``.

    Raises TimeoutError if the child has not answered within ``timeout`` seconds (it is
    killed), RuntimeError with its traceback if it failed.
    """
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    with tempfile.TemporaryDirectory() as directory:
        child = context.Process(
            target=_child,
            args=(send, [tuple(s) for s in shapes], rank, threads, passes, directory),
            daemon=True,
        )
        child.start()
        send.close()
        try:
            if not receive.poll(timeout):
                raise TimeoutError(
                    f"timing torch's PowerSGD hook (rank {rank}) did not finish within "
                    f"{timeout:g} s; pass a larger timeout, or fewer passes"
                )
            try:
                kind, answer = receive.recv()
            except EOFError:  # it died before answering (killed, or it could not start)
                child.join()
                raise RuntimeError(
                    f"timing torch's PowerSGD hook: the child process exited with code "
                    f"{child.exitcode} before answering"
                ) from None
        finally:
            child.kill()
            child.join()
    if kind == "error":
        raise RuntimeError(f"timing torch's PowerSGD hook failed:\n{answer}")
    return answer


class _Gradients(nn.Module):
    """Parameters of ``shapes`` whose gradient in every pass is the same random tensor."""

    def __init__(self, shapes: Sequence[tuple[int, ...]]) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(shape)) for shape in shapes)
        self.gradients = [torch.randn(shape, generator=generator) for shape in shapes]

    def forward(self) -> torch.Tensor:
        return torch.stack([(w * g).sum() for w, g in zip(self.weights, self.gradients)]).sum()


def _child(
    send: Connection,
    shapes: list[tuple[int, ...]],
    rank: int,
    threads: int,
    passes: int,
    directory: str,
) -> None:
    try:
        send.send(("ok", _time(shapes, rank, threads, passes, directory)))
    except BaseException:
        send.send(("error", traceback.format_exc()))
    send.close()
    leave_process(0)


def _time(
    shapes: list[tuple[int, ...]], rank: int, threads: int, passes: int, directory: str
) -> HookTiming:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cores[: max(1, threads)])
    torch.set_num_threads(max(1, threads))
    init = f"file://{os.path.join(directory, 'init')}"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    # The floor in one bucket too, as the hooked model has.
    floor = DistributedDataParallel(_Gradients(shapes), bucket_cap_mb=ONE_BUCKET_BYTES >> 20)
    floor.register_comm_hook(None, unchanged_hook)
    method = parse_method(f"powersgd(rank={rank})")
    hooked, state = attach_method(method, _Gradients(shapes), density=1.0, start=START)
    times: dict[str, list[float]] = {"floor": [], "hooked": []}
    for number in range(WARMUP + passes):
        for name, model in (("floor", floor), ("hooked", hooked)):
            loss = model()
            started = time.perf_counter()
            loss.backward()
            elapsed = time.perf_counter() - started
            model.zero_grad(set_to_none=True)
            if number >= WARMUP:
                times[name].append(elapsed)
    added = statistics.median(times["hooked"]) - statistics.median(times["floor"])
    _, _, sent = state.compression_stats()  # summed over every pass from START on
    compressed = WARMUP + passes - state.start_powerSGD_iter
    return HookTiming(seconds=max(0.0, added), sent=int(sent) // compressed)
