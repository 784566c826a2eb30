"""Step times predicted from the simulated message shapes on α–β networks
(:mod:`~microsparse_lab.bench.costmodel`), beside the peers'
(:mod:`~microsparse_lab.bench.peermodel`)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from microsparse_lab.bench import costmodel, peermodel
from microsparse_lab.bench.simulate.config import EXACT_WORKERS
from microsparse_lab.bench.workload import RESNET18_NUMEL, layout_from_sizes
from microsparse_lab.methods.names import Variant, find_variants


@dataclass(frozen=True)
class PredictConfig:
    rates_gbit: tuple[float, ...] = (10.0, 25.0, 100.0)
    workers: tuple[int, ...] = (16, 64, 256, 1024)
    numel: int = RESNET18_NUMEL
    latency_us: float = 20.0
    compute_ms: float = 0.0
    select_results: str | None = None  # ``microsparse bench select``'s select.json
    algorithms: str = "ring"  # or "best": the faster of ring and recursive doubling
    peers: tuple[str, ...] = peermodel.DEFAULT_PEERS  # torch's hooks and stock DDP beside


def shapes_from(result: dict[str, Any]) -> dict[tuple[str, int], costmodel.StepShape]:
    """(sparsifier label, n) → the simulated :class:`~costmodel.StepShape`."""
    return {
        (row["sparsifier"], row["world_size"]): costmodel.StepShape(**row["shape"])
        for row in result["rows"]
    }


def predict(result: dict[str, Any], config: PredictConfig) -> dict[str, Any]:
    """Step time of every simulated sparsifier at ``config``'s networks, n and d.

    Messages: the simulated shape at the nearest simulated n, scaled to ``config.numel``.
    Local overhead: ``bench select``'s whole per-step overhead at the nearest d and n when
    ``select_results`` is given (same sparsifier label), else the simulator's selection time
    scaled by d/d_simulated (selection only).

    The peers (``config.peers``: stock DDP, torch's fp16/bf16 and PowerSGD hooks) follow
    :func:`peermodel.predict_rows`: their collectives from ResNet-18's layer shapes widened to
    d, DDP's buckets, and their own arithmetic timed on this machine.
    """
    shapes = shapes_from(result)
    overheads, overhead_source = _overheads(config, result)
    density = result["config"]["density"]
    rows = []
    for label in dict.fromkeys(label for label, _ in shapes):
        for world_size in config.workers:
            at = nearest_simulated([n for name, n in shapes if name == label], world_size)
            shape = costmodel.scaled(shapes[(label, at)], config.numel)
            if shape.exchange == "fixed":  # the capacity follows k/n, not the counts
                variant = find_variants((label,), density)[0]
                capacity = capacity_at(variant, density, config.numel, world_size)
                shape = dataclasses.replace(shape, max_local_selected=capacity)
            overhead = overheads(label, world_size)
            for gbit in config.rates_gbit:
                network = costmodel.Network.of(gbit, config.latency_us)
                comm = costmodel.communication_seconds(
                    shape, world_size, network, config.algorithms
                )
                rows.append({
                    "sparsifier": label,
                    "world_size": world_size,
                    "simulated_at": at,
                    "gbit_per_s": gbit,
                    "communication_ms": 1e3 * comm,
                    "overhead_ms": overhead,
                    "compute_ms": config.compute_ms,
                    "step_ms": config.compute_ms + overhead + 1e3 * comm,
                })  # fmt: skip
    rows += peermodel.predict_rows(
        config.peers, config.numel, config.workers, config.rates_gbit, config.latency_us,
        config.compute_ms, config.algorithms,
    )  # fmt: skip
    dense = {
        (r["world_size"], r["gbit_per_s"]): r["step_ms"] for r in rows if r["sparsifier"] == "dense"
    }
    for row in rows:
        reference = dense.get((row["world_size"], row["gbit_per_s"]))
        row["speedup_vs_dense"] = reference / row["step_ms"] if reference else None
    largest = max(n for _, n in shapes)
    return {
        "config": asdict(config),
        "model": costmodel.describe(),
        "overhead_source": overhead_source,
        "simulated_workers": sorted({n for _, n in shapes}),
        "beyond_simulated": [n for n in config.workers if n > largest],
        "rows": rows,
    }


def nearest_simulated(sizes: list[int], world_size: int) -> int:
    """The simulated n (of ``sizes``) nearest ``world_size`` on a log scale.

    Example:
        >>> nearest_simulated([1, 4, 16, 64], 1024), nearest_simulated([1, 4, 16, 64], 20)
        (64, 16)
    """
    return min(sizes, key=lambda n: abs(math.log2(n) - math.log2(world_size)))


def beyond_note(prediction: dict[str, Any]) -> str:
    """What the prediction took from a smaller n than it predicts; '' if nothing."""
    beyond = prediction.get("beyond_simulated")
    if not beyond:
        return ""
    largest = max(prediction["simulated_workers"])
    return (
        f"n = {', '.join(map(str, beyond))} not simulated: their message shapes are those "
        f"simulated at n = {largest}, scaled to d. Union sparsifiers' K grows with n, so their "
        f"bytes and times there are likely underestimated; simulate those n with --workers "
        f"{','.join(map(str, EXACT_WORKERS))} (tens of minutes, up to ~14 GB)."
    )


def capacity_at(variant: Variant, density: float, numel: int, world_size: int) -> int:
    """Index slots per rank of a ``fixed`` exchange: the sparsifier's own ``capacity``."""
    sparsifier = variant.create(density)
    sparsifier.bind(layout_from_sizes([numel]), 0, world_size)
    return sparsifier.framing().capacity  # type: ignore[attr-defined]


def _overheads(
    config: PredictConfig, result: dict[str, Any]
) -> tuple[Callable[[str, int], float], str]:
    simulated = {(r["sparsifier"], r["world_size"]): r["select_ms"] for r in result["rows"]}
    scale = config.numel / result["numel"]

    def from_simulation(label: str, world_size: int) -> float:
        sizes = [n for name, n in simulated if name == label]
        best = min(sizes, key=lambda n: abs(math.log2(n) - math.log2(world_size)))
        return simulated[(label, best)] * scale

    if not config.select_results or not Path(config.select_results).is_file():
        return from_simulation, (
            f"selection time of the simulator at d = {result['numel']:,}, × {scale:.3g} "
            "(selection only)"
        )

    measured = json.loads(Path(config.select_results).read_text())
    rows = [r for r in measured["rows"] if r["device"] == "cpu"]
    sizes = sorted({r["numel"] for r in rows})
    numel = min(sizes, key=lambda d: abs(math.log(d) - math.log(config.numel)))

    def from_select(label: str, world_size: int) -> float:
        mine = [r for r in rows if r["sparsifier"] == label and r["numel"] == numel]
        if not mine:
            return from_simulation(label, world_size)
        best = min(mine, key=lambda r: abs(math.log2(r["world_size"]) - math.log2(world_size)))
        return best["overhead_ms"] * config.numel / numel

    return from_select, (
        f"whole per-step overhead from {config.select_results} at d = {numel:,} "
        f"(cpu, nearest n), × {config.numel / numel:.3g}"
    )
