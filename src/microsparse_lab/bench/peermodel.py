"""What the peers cost per step: their bytes (:mod:`microsparse_lab.methods.traffic`) on the
α–β network model, plus their own work on this machine.

:func:`local_seconds` times the compression's own work (the casts; torch's PowerSGD hook end
to end), which the network model cannot know; :func:`predict_rows` adds it up for
``simulate --predict``; :mod:`~microsparse_lab.bench.validation` holds the model against the
test bed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import torch

from microsparse_lab.bench import costmodel
from microsparse_lab.bench.peertime import powersgd_seconds
from microsparse_lab.methods.names import PEERS, parse_method
from microsparse_lab.methods.traffic import Shape, peer_bytes, peer_collectives
from microsparse_lab.training.models import build_resnet18

DEFAULT_PEERS = ("ddp", "fp16", "bf16", "powersgd", "powersgd(rank=4)")
"""The peers ``microsparse simulate --predict`` adds beside the sparsifiers."""


def scaled_shapes(shapes: Sequence[Shape], numel: int) -> list[tuple[int, ...]]:
    """The same architecture made wider to ``numel`` entries in all: every matrix's rows and
    columns times √(numel/d), vectors times the same (so PowerSGD's P and Q grow with √)."""
    total = sum(math.prod(shape) for shape in shapes)
    factor = math.sqrt(numel / total)
    scaled = []
    for shape in shapes:
        rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (0, 0)
        if rows:
            scaled.append((max(1, round(rows * factor)), max(1, round(cols * factor))))
        else:
            scaled.append((max(1, round(math.prod(shape) * factor)),))
    return scaled


def local_seconds(
    name: str,
    shapes: Sequence[Shape],
    world_size: int,
    repeats: int = 5,
    threads: int | None = None,
) -> float:
    """Median seconds of the peer's own work for one step on this machine, on gradients of
    ``shapes`` and ``threads`` torch threads (default: the caller's): nothing for ``ddp``;
    division and the casts for ``fp16``/``bf16``; for PowerSGD, what torch's
    ``powerSGD_hook`` adds to DDP's backward pass on one rank, end to end
    (:mod:`microsparse_lab.bench.peertime`; its work does not depend on n).

    Example:
        >>> local_seconds("ddp", [(10, 10)], 2)
        0.0
    """
    method = parse_method(name)
    if method.kind != "peer":
        raise ValueError(f"{name!r} is not a peer; choose from {', '.join(PEERS)}")
    if method.sparsifier == "ddp":
        return 0.0
    threads = torch.get_num_threads() if threads is None else threads
    if method.sparsifier == "powersgd":
        return powersgd_seconds(shapes, method.rank, threads, passes=repeats).seconds
    generator = torch.Generator().manual_seed(0)
    flat = torch.randn(sum(math.prod(shape) for shape in shapes), generator=generator)
    dtype = torch.float16 if method.sparsifier == "fp16" else torch.bfloat16
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for _ in range(repeats + 1):  # the first call warms the allocator and is left out
            started = time.perf_counter()
            flat.copy_(flat.div(world_size).to(dtype))
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)
    return statistics.median(times[1:])


def resnet18_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of the CIFAR ResNet-18 (``bench cluster``'s model)."""
    return [tuple(p.shape) for p in build_resnet18(num_classes=10).parameters()]


def predict_rows(
    names: Sequence[str],
    numel: int,
    workers: Sequence[int],
    rates_gbit: Sequence[float],
    latency_us: float,
    compute_ms: float = 0.0,
    algorithms: str = "ring",
) -> list[dict[str, object]]:
    """``simulate --predict``'s rows for the peers: ResNet-18's layers widened to ``numel``
    (:func:`scaled_shapes`), DDP's buckets, the α–β collectives and :func:`local_seconds`.

    ``step_ms`` adds everything up (nothing hidden); ``overlapped_step_ms`` is the bound
    where DDP hides all communication behind the backward pass: max(compute + local,
    communication), except with one bucket (PowerSGD here), which is ready only when
    backward ends and hides nothing.
    """
    shapes = resnet18_shapes()
    if numel != sum(math.prod(shape) for shape in shapes):
        shapes = scaled_shapes(shapes, numel)  # type: ignore[assignment]
    rows: list[dict[str, object]] = []
    for name in names:
        local_ms = 1e3 * local_seconds(name, shapes, max(2, max(workers)))
        one_bucket = parse_method(name).one_bucket
        for world_size in workers:
            collectives = peer_collectives(name, shapes, world_size)
            sent = peer_bytes(name, shapes, world_size)
            for gbit in rates_gbit:
                network = costmodel.Network.of(gbit, latency_us)
                comm_ms = 1e3 * sum(
                    costmodel.collective_seconds(kind, size, world_size, network, algorithms)
                    for kind, size in collectives
                )
                rows.append({
                    "sparsifier": name,
                    "kind": "peer",
                    "world_size": world_size,
                    "gbit_per_s": gbit,
                    "communication_ms": comm_ms,
                    "overhead_ms": local_ms,
                    "compute_ms": compute_ms,
                    "step_ms": compute_ms + local_ms + comm_ms,
                    "overlapped_step_ms": compute_ms + local_ms + comm_ms
                    if one_bucket
                    else max(compute_ms + local_ms, comm_ms),
                    "collectives": len(collectives),
                    "bytes_per_worker": sent,
                })  # fmt: skip
    return rows
