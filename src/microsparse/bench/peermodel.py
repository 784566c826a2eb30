"""What the peers send and compute per step, from a model's layer shapes.

The peers are the gradient exchanges a user would pick instead of microsparse
(:mod:`microsparse.bench.peers`): stock DDP, its fp16/bf16 compression hooks and PowerSGD.
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
that). :func:`local_seconds` times the compression's own work on this machine (the casts;
torch's PowerSGD hook end to end), which the network model cannot know.

Example:
    >>> shapes = [(64, 3, 3, 3), (64,), (10, 64), (10,)]
    >>> peer_collectives("ddp", shapes, 4)  # 2,442 entries: one bucket
    [('all_reduce', 9768)]
    >>> peer_collectives("powersgd(rank=1)", shapes, 4)  # the biases raw, then P, then Q
    [('all_reduce', 296), ('all_reduce', 296), ('all_reduce', 364)]
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import torch

from microsparse.bench import peers

MIB = 1 << 20
DDP_FIRST_BUCKET_BYTES = 1 * MIB
"""DDP's first bucket when ``bucket_cap_mb`` is left at its default."""
DDP_BUCKET_BYTES = 25 * MIB
"""DDP's ``bucket_cap_mb`` default, in bytes."""
ONE_BUCKET_BYTES = 10_000 * MIB
"""``bench cluster``'s PowerSGD bucket limit: one bucket holds the whole model."""
MIN_COMPRESSION_RATE = 2
"""torch's ``PowerSGDState`` default: compress a matrix only if that saves more than half."""
DEFAULT_PEERS = ("ddp", "fp16", "bf16", "powersgd", "powersgd(rank=4)")
"""The peers ``microsparse simulate --predict`` adds beside the sparsifiers."""

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
    buckets as ``microsparse bench cluster`` builds them (``bench.peers.attach``)."""
    method = peers.parse(name)
    if method.kind != "peer":
        raise ValueError(f"{name!r} is not a peer; choose from {', '.join(peers.PEERS)}")
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
    from microsparse.comm.collectives import all_reduce_bytes

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
    (:mod:`microsparse.bench.peertime`; its work does not depend on n).

    Example:
        >>> local_seconds("ddp", [(10, 10)], 2)
        0.0
    """
    method = peers.parse(name)
    if method.kind != "peer":
        raise ValueError(f"{name!r} is not a peer; choose from {', '.join(peers.PEERS)}")
    if method.sparsifier == "ddp":
        return 0.0
    threads = torch.get_num_threads() if threads is None else threads
    if method.sparsifier == "powersgd":
        from microsparse.bench.peertime import powersgd_seconds

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
    from microsparse.training.models import build_resnet18

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
    from microsparse.bench import costmodel

    shapes = resnet18_shapes()
    if numel != sum(math.prod(shape) for shape in shapes):
        shapes = scaled_shapes(shapes, numel)  # type: ignore[assignment]
    rows: list[dict[str, object]] = []
    for name in names:
        local_ms = 1e3 * local_seconds(name, shapes, max(2, max(workers)))
        one_bucket = peers.parse(name).one_bucket
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


def validate_peers(results: dict[str, object], latency_us: float) -> list[dict[str, object]]:
    """Compare the peers' model with ``microsparse bench cluster``'s ``results.json``.

    The peers run inside DDP's backward, so the test bed cannot time their exchange apart
    from compute. Model step = the step of DDP without an exchange (the ``none@ddp`` row; the
    ``none`` row where the run has none) + the peer's local work (:func:`local_seconds`) +
    its collectives at the probed rate (nothing hidden), and the overlapped bound = that
    base − its compute + max(its compute + local, collectives), except with one bucket (ready
    only when backward ends). The local work is timed on the threads each test-bed worker had
    (cores // hosts, at least 1). It is CPU-bound and runs on every worker at once, so where
    the test bed has more workers' threads than cores it is stretched by hosts · threads /
    cores (``shared_cores``; 1 where the file does not say how many cores it had). Bytes: the
    model's against the link counters.
    """
    from microsparse.bench import costmodel
    from microsparse.bench.cluster_worker import MODELS

    config = results.get("config", {})
    model = MODELS[config.get("model", "resnet18")](config.get("seed", 1))  # type: ignore[union-attr]
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    local_ms: dict[tuple[str, int], float] = {}
    cores = int(results.get("machine", {}).get("cores") or 0)  # type: ignore[union-attr]
    rows: list[dict[str, object]] = []
    for configuration in results.get("configurations", []):  # type: ignore[union-attr]
        n, probe = configuration["hosts"], configuration.get("probe", {})
        gbit = probe.get("wire_gbit_per_s") or probe.get("modelled_gbit_per_s")
        named = {r["sparsifier"]: r for r in configuration["rows"]}
        base = named.get(peers.DDP_FLOOR) or named.get(peers.NO_EXCHANGE)
        if not gbit or base is None:
            continue
        network = costmodel.Network.of(gbit, latency_us)
        threads = max(1, cores // n)  # what each test-bed worker had (1 if not recorded)
        shared = max(1.0, n * threads / cores) if cores else 1.0
        for row in configuration["rows"]:
            name = row["sparsifier"]
            try:
                if peers.parse(name).kind != "peer":
                    continue
            except ValueError:
                continue
            if (name, threads) not in local_ms:
                local_ms[name, threads] = 1e3 * local_seconds(name, shapes, n, threads=threads)
            local = local_ms[name, threads] * shared
            comm_ms = 1e3 * sum(
                costmodel.collective_seconds(kind, size, n, network)
                for kind, size in peer_collectives(name, shapes, n)
            )
            serial = base["step_ms"] + local + comm_ms
            hidden = base["step_ms"] - base["compute_ms"] + max(base["compute_ms"] + local, comm_ms)
            if peers.parse(name).one_bucket:
                hidden = serial
            rows.append({
                "hosts": n,
                "rate": configuration["rate"],
                "sparsifier": name,
                "measured_step_ms": row["step_ms"],
                "base": base["sparsifier"],
                "base_step_ms": base["step_ms"],
                "shared_cores": shared,
                "local_ms": local,
                "communication_ms": comm_ms,
                "predicted_step_ms": serial,
                "overlapped_step_ms": hidden,
                "step_ratio": serial / row["step_ms"],
                "modelled_bytes": peer_bytes(name, shapes, n),
                "wire_bytes": row.get("wire_bytes_per_step"),
            })  # fmt: skip
    return rows
