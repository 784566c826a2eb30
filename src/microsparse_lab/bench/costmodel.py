"""An α–β model of one training step: compute + local overhead + the reducer's collectives.

Every link sends β bytes per second after a start-up latency α per message. Collectives are
the ring algorithms gloo and NCCL use for large messages, with n workers:

- all-reduce of p bytes: 2(n − 1)·(α + p/(nβ)) (reduce-scatter, then all-gather, of p/n chunks);
- all-gather of m bytes per rank: (n − 1)·(α + m/β);
- broadcast of m bytes: the faster of a binomial tree, ⌈log2 n⌉·(α + m/β), and a pipelined
  chain, (n − 1)·α + m/β (libraries pick by message size).

A ring pays 2(n − 1)·α of latency per all-reduce whatever the size. With ``algorithms="best"``
each collective takes the faster of the ring and recursive doubling (all-reduce
⌈log2 n⌉·(α + p/β), all-gather ⌈log2 n⌉·α + (n − 1)·m/β), as libraries do for small messages.

The collectives of one step are those ``GradientReducer.synchronize`` issues
(:func:`reducer_collectives`); a step takes ``compute + overhead + Σ collectives``, nothing
overlapped (the loop integration runs the exchange after backward).

Example:
    >>> network = Network(latency=1e-5, bandwidth=1.25e9)   # 10 µs, 10 Gbit/s
    >>> round(all_reduce_seconds(4_000_000, 4, network) * 1e3, 3)   # 4 MB over 4 workers
    4.86
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from microsparse.comm import Compact, Dense, Fixed, FixedUnion, Framing, Padded, Shared
from microsparse.engine import step_collectives

FRAMINGS: dict[str, type[Framing]] = {
    "padded": Padded, "union": Padded, "fixed_union": FixedUnion, "fixed": Fixed,
    "compact": Compact, "shared": Shared, "dense": Dense,
}  # fmt: skip
"""Framing classes by the label ``StepStats.exchange`` reports."""


@dataclass(frozen=True)
class Network:
    """α (seconds per message) and β (bytes per second per link and direction)."""

    latency: float
    bandwidth: float

    @classmethod
    def of(cls, gbit_per_s: float, latency_us: float) -> Network:
        """A network of ``gbit_per_s`` Gbit/s links with ``latency_us`` µs per message."""
        return cls(latency_us * 1e-6, gbit_per_s * 1e9 / 8)


def all_reduce_seconds(payload_bytes: float, world_size: int, network: Network) -> float:
    n = world_size
    if n == 1 or payload_bytes == 0:
        return 0.0
    return 2 * (n - 1) * (network.latency + payload_bytes / (n * network.bandwidth))


def all_gather_seconds(message_bytes: float, world_size: int, network: Network) -> float:
    n = world_size
    if n == 1:
        return 0.0
    return (n - 1) * (network.latency + message_bytes / network.bandwidth)


def broadcast_seconds(message_bytes: float, world_size: int, network: Network) -> float:
    n = world_size
    if n == 1:
        return 0.0
    transfer = message_bytes / network.bandwidth
    tree = math.ceil(math.log2(n)) * (network.latency + transfer)
    chain = (n - 1) * network.latency + transfer
    return min(tree, chain)


def doubling_all_reduce_seconds(payload_bytes: float, world_size: int, network: Network) -> float:
    """Recursive doubling: ⌈log2 n⌉ rounds, each exchanging the whole payload."""
    if world_size == 1 or payload_bytes == 0:
        return 0.0
    return math.ceil(math.log2(world_size)) * (network.latency + payload_bytes / network.bandwidth)


def doubling_all_gather_seconds(message_bytes: float, world_size: int, network: Network) -> float:
    """Recursive doubling: ⌈log2 n⌉ rounds, the same (n − 1)·m bytes as the ring."""
    if world_size == 1:
        return 0.0
    rounds = math.ceil(math.log2(world_size))
    return rounds * network.latency + (world_size - 1) * message_bytes / network.bandwidth


_RING = {"all_reduce": all_reduce_seconds, "all_gather": all_gather_seconds,
         "broadcast": broadcast_seconds}  # fmt: skip
_DOUBLING = {"all_reduce": doubling_all_reduce_seconds,
             "all_gather": doubling_all_gather_seconds, "broadcast": broadcast_seconds}  # fmt: skip
ALGORITHMS = ("ring", "best")
"""``ring``: every collective as a ring; ``best``: the faster of ring and recursive doubling
for each collective, as libraries choose by message size (small messages: doubling)."""


def collective_seconds(
    kind: str, size: float, world_size: int, network: Network, algorithms: str = "ring"
) -> float:
    """α–β time of one collective (``kind`` as in :func:`reducer_collectives`)."""
    ring = _RING[kind](size, world_size, network)
    if algorithms == "ring":
        return ring
    if algorithms != "best":
        raise ValueError(f"algorithms must be one of {', '.join(ALGORITHMS)}, got {algorithms!r}")
    return min(ring, _DOUBLING[kind](size, world_size, network))


@dataclass(frozen=True)
class StepShape:
    """The message sizes of one step of one sparsifier (what the simulator measures)."""

    exchange: str  # the framing's label: "fixed", "compact", "padded", "union", "fixed_union",
    # "shared" or "dense"
    numel: int  # d
    selected: float  # K, distinct positions averaged
    max_local_selected: float  # indices per rank's index message: max_r k_r, or the capacity
    agreement_bytes: float = 0  # an all-reduced vector before selection (MiCRO's histogram)
    plan_bytes: float = 0  # a leader's broadcast plan (CLT-k, DEFT)
    index_bytes: int = 4  # one index on the wire
    value_bytes: int = 4  # one value on the wire


def reducer_collectives(shape: StepShape, world_size: int) -> list[tuple[str, float]]:
    """(kind, bytes) of every collective one step of ``shape`` issues, in order
    (:func:`microsparse.engine.step_collectives`).

    Example:
        >>> shape = StepShape("padded", numel=10**6, selected=1000, max_local_selected=300)
        >>> reducer_collectives(shape, 4)
        [('all_gather', 8), ('all_gather', 16), ('all_gather', 1200), ('all_reduce', 4000)]
    """
    if world_size == 1:
        return []
    return step_collectives(
        FRAMINGS[shape.exchange],
        slots=shape.max_local_selected,
        values=_values(shape, world_size),
        index_bytes=shape.index_bytes,
        value_bytes=shape.value_bytes,
        agreement_bytes=shape.agreement_bytes,
        planned=bool(shape.plan_bytes),
        plan_bytes=shape.plan_bytes,
    )


def _values(shape: StepShape, world_size: int) -> float:
    """Entries in the values' all-reduce: d, every rank's slots (a fixed union), or K."""
    if shape.exchange == "dense":
        return shape.numel
    if shape.exchange == "fixed_union":
        return world_size * shape.max_local_selected
    return shape.selected


def communication_seconds(
    shape: StepShape, world_size: int, network: Network, algorithms: str = "ring"
) -> float:
    """Σ of the α–β times of :func:`reducer_collectives`."""
    return sum(
        collective_seconds(kind, size, world_size, network, algorithms)
        for kind, size in reducer_collectives(shape, world_size)
    )


def step_seconds(
    shape: StepShape,
    world_size: int,
    network: Network,
    compute: float = 0.0,
    overhead: float = 0.0,
    algorithms: str = "ring",
) -> float:
    """Predicted step time: ``compute`` (forward + backward) + ``overhead`` (local work of
    the reducer: selection, packing, write-back) + communication."""
    return compute + overhead + communication_seconds(shape, world_size, network, algorithms)


def scaled(shape: StepShape, numel: int) -> StepShape:
    """The same sparsifier at another d and the same density: every count scales with d/d₀.

    The fixed-size messages (agreement vector, a plan that is not a list of k positions)
    keep their size.
    """
    factor = numel / shape.numel
    plan = shape.plan_bytes
    return StepShape(
        shape.exchange,
        numel,
        shape.selected * factor,
        shape.max_local_selected * factor,
        shape.agreement_bytes,
        plan * factor if plan and plan_is_positions(shape) else plan,
        shape.index_bytes,
        shape.value_bytes,
    )


def plan_is_positions(shape: StepShape) -> bool:
    """Whether the plan is a list of K indices (CLT-k's leader top-k), which grows with d;
    others (DEFT's per-fragment table) depend on the layout only."""
    return math.isclose(shape.plan_bytes, shape.selected * shape.index_bytes, rel_tol=0.01)


def describe() -> dict[str, Any]:
    """The model's formulas, for the JSON records."""
    return {
        "all_reduce": "2(n-1)(alpha + p/(n beta))",
        "all_gather": "(n-1)(alpha + m/beta), m per rank",
        "broadcast": "min(ceil(log2 n)(alpha + m/beta), (n-1) alpha + m/beta)",
        "best": "min(ring, recursive doubling): all-reduce ceil(log2 n)(alpha + p/beta), "
        "all-gather ceil(log2 n) alpha + (n-1) m/beta",
        "step": "compute + overhead + sum of the reducer's collectives",
    }
