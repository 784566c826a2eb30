"""What the peer methods send per step, from a model's layer shapes.

The peers are the gradient exchanges a user would pick instead of microsparse (stock DDP, its
fp16/bf16 compression hooks and PowerSGD; :mod:`microsparse_lab.methods.names`). These sizes
are what ``train --ddp-hook`` reports as a peer's bytes and what the simulator's peer model
(:mod:`microsparse_lab.bench.peermodel`) times.

All run through DDP, which groups the gradients into buckets and all-reduces each bucket as
soon as backward has filled it:

- ``ddp``: one all-reduce of 4 bytes per entry for every bucket;
- ``fp16``, ``bf16``: the same with 2 bytes per entry;
- ``powersgd(rank=r)``: for every bucket, three all-reduces in turn, as torch's
  ``powerSGD_hook`` issues them: the tensors not worth compressing (vectors, and matrices
  with ``(rows + cols) · r · 2 ≥ rows · cols``, torch's default ``min_compression_rate``),
  then every compressed matrix's P (rows × min(rows, cols, r)), then every Q (cols × the
  same); a matrix is the parameter viewed as ``shape[0] × rest``.

Buckets are DDP's: parameters in reverse order, a bucket closed once it holds at least its
limit (the first 1 MiB when DDP's ``bucket_cap_mb`` is left at its default, 25 MiB after
that).

Example:
    >>> shapes = [(64, 3, 3, 3), (64,), (10, 64), (10,)]
    >>> peer_collectives("ddp", shapes, 4)  # 2,442 entries: one bucket
    [('all_reduce', 9768)]
    >>> peer_collectives("powersgd(rank=1)", shapes, 4)  # the biases raw, then P, then Q
    [('all_reduce', 296), ('all_reduce', 296), ('all_reduce', 364)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from microsparse.comm import all_reduce_bytes
from microsparse_lab.methods.names import PEERS, Method, parse_method

MIB = 1 << 20
DDP_FIRST_BUCKET_BYTES = 1 * MIB
"""DDP's first bucket when ``bucket_cap_mb`` is left at its default."""
DDP_BUCKET_BYTES = 25 * MIB
"""DDP's ``bucket_cap_mb`` default, in bytes."""
ONE_BUCKET_BYTES = 10_000 * MIB
"""``bench cluster``'s PowerSGD bucket limit: one bucket holds the whole model."""
MIN_COMPRESSION_RATE = 2
"""torch's ``PowerSGDState`` default: compress a matrix only if that saves more than half."""
Shape = Sequence[int]


def ddp_buckets(
    shapes: Sequence[Shape],
    bucket_bytes: int = DDP_BUCKET_BYTES,
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
    element_bytes: int = 4,
) -> list[list[int]]:
    """Parameter indices of each DDP bucket, in the order DDP fills them (last layer first).

    Example:
        >>> ddp_buckets([(300_000,), (300_000,), (10,)], first_bucket_bytes=MIB)
        [[2, 1], [0]]
    """
    buckets: list[list[int]] = [[]]
    filled, limit = 0, first_bucket_bytes
    for index in reversed(range(len(shapes))):
        buckets[-1].append(index)
        filled += math.prod(shapes[index]) * element_bytes
        if filled >= limit:
            buckets.append([])
            filled, limit = 0, bucket_bytes
    return [bucket for bucket in buckets if bucket]


def peer_collectives(
    name: str, shapes: Sequence[Shape], world_size: int
) -> list[tuple[str, float]]:
    """(kind, bytes) of every collective one step of the peer ``name`` issues, with DDP's
    buckets as ``microsparse bench cluster`` builds them
    (:func:`~microsparse_lab.methods.hooks.attach_method`)."""
    method = parse_method(name)
    if method.kind != "peer":
        raise ValueError(f"{name!r} is not a peer; choose from {', '.join(PEERS)}")
    if world_size == 1:
        return []
    if method.one_bucket:
        limits = (ONE_BUCKET_BYTES, ONE_BUCKET_BYTES)
    else:
        limits = (DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES)
    steps: list[tuple[str, float]] = []
    for bucket in ddp_buckets(shapes, *limits):
        sizes = [shapes[index] for index in bucket]
        if method.sparsifier == "ddp":
            steps.append(("all_reduce", 4 * sum(math.prod(shape) for shape in sizes)))
        elif method.sparsifier in ("fp16", "bf16"):
            steps.append(("all_reduce", 2 * sum(math.prod(shape) for shape in sizes)))
        else:
            raw, ps, qs = _powersgd_entries(sizes, method.rank)
            steps += [("all_reduce", 4 * raw), ("all_reduce", 4 * ps), ("all_reduce", 4 * qs)]
    return steps


def peer_bytes(name: str, shapes: Sequence[Shape], world_size: int) -> int:
    """Bytes one rank sends per step in the ring model (every collective an all-reduce)."""
    return sum(
        all_reduce_bytes(int(size), world_size)
        for _, size in peer_collectives(name, shapes, world_size)
    )


def powersgd_factors(
    shape: Shape, rank: int, min_compression_rate: float = MIN_COMPRESSION_RATE
) -> tuple[int, int] | None:
    """Entries of P and Q for a parameter of ``shape``, or None where torch's hook sends it
    uncompressed: it views the tensor as rows = shape[0] by the rest, keeps r = min(rows, cols,
    rank) and compresses only if (rows + cols)·r·``min_compression_rate`` < rows·cols.

    Example:
        >>> powersgd_factors((64, 3, 3, 3), rank=4), powersgd_factors((10,), rank=4)
        ((256, 108), None)
        >>> powersgd_factors((2, 128), rank=4)  # r = 2: (2 + 128)·2·2 < 256 fails
    """
    if len(shape) == 0:
        return None
    rows = shape[0]
    cols = math.prod(shape[1:])
    kept = min(rows, cols, rank)
    if (rows + cols) * kept * min_compression_rate < rows * cols:
        return rows * kept, cols * kept
    return None


def _powersgd_entries(shapes: Sequence[Shape], rank: int) -> tuple[int, int, int]:
    raw = ps = qs = 0
    for shape in shapes:
        factors = powersgd_factors(shape, rank)
        if factors is None:
            raw += math.prod(shape)
        else:
            ps, qs = ps + factors[0], qs + factors[1]
    return raw, ps, qs


def modelled_bytes(method: Method, model: nn.Module, world_size: int) -> int | None:
    """Bytes one rank sends per step in a ring model, for the peers (None for the others):
    :func:`peer_bytes` on the model's layer shapes."""
    if method.kind != "peer":
        return None
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    return peer_bytes(method.name, shapes, world_size)
