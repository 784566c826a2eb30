"""n gloo ranks on loopback: one ``synchronize()`` against a dense all-reduce, in one run.

Every rank holds the same d-parameter model layout (``bench.workload.model_layout``) and its
own synthetic gradient. Alternating, with a barrier before each, it times

- a plain ``dist.all_reduce`` of the whole flat gradient (what DDP does, bucketed), and
- ``GradientReducer.synchronize()`` of each sparsifier variant, with every ``p.grad`` set to a
  fresh tensor first (as after ``zero_grad()`` and backward), and
- the first variant's two rounds alone, at the sizes its step sent once warmed up: the
  all-gather of its index message and the all-reduce of its values. A step of MiCRO needs
  both, one after the other (the values are summed at positions the indices name), where a
  dense all-reduce is one round; with many ranks on few cores a round's latency, not its
  bytes, can decide,

in process CPU time (user + system, gloo's threads included: the work, not the scheduler, on
an oversubscribed machine) and wall time. Reports medians per rank and their ratio to the
all-reduce. Uses only the public API, so it measures any version of the package.

Example:
    >>> result = run(LoopbackConfig(numel=100_000, repeats=3))  # doctest: +SKIP
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from microsparse import GradientReducer
from microsparse.comm import Collective, ProcessGroupCollectives, index_dtype
from microsparse.stats import StepStats
from microsparse_lab.bench.costmodel import FRAMINGS
from microsparse_lab.bench.workload import RESNET18_NUMEL, model_layout, synthetic_gradient
from microsparse_lab.training.launch import leave_process

REFERENCE = {"selection": "threshold", "threshold_rule": "as_coded",
             "partitioning": "contiguous", "index_message": "padded"}  # fmt: skip


@dataclass(frozen=True)
class LoopbackConfig:
    numel: int = RESNET18_NUMEL
    ranks: int = 4
    density: float = 0.001
    repeats: int = 15
    warmup: int = 3
    variants: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {"micro": {}, "micro-reference": REFERENCE}
    )
    """label -> GradientReducer options; ``sparsifier`` among them names another than MiCRO."""

    def __post_init__(self) -> None:
        if self.warmup < 1:  # the bare rounds take their sizes from a warm-up step
            raise ValueError(f"warmup: must be at least 1, got {self.warmup}")
        if self.repeats < 1:
            raise ValueError(f"repeats: must be at least 1, got {self.repeats}")


def run(config: LoopbackConfig) -> dict[str, Any]:
    """Spawn ``config.ranks`` gloo ranks on loopback and time them; returns the JSON record."""
    with tempfile.TemporaryDirectory() as folder:
        init = Path(folder) / "init"
        out = Path(folder) / "rank0.pt"
        mp.spawn(_rank, args=(config, str(init), str(out)), nprocs=config.ranks)
        ranks = torch.load(out, weights_only=False)
    rows = []
    for name in config.variants:
        cpu = statistics.median(r[name]["cpu"] / r["all_reduce"]["cpu"] for r in ranks)
        wall = statistics.median(r[name]["wall"] / r["all_reduce"]["wall"] for r in ranks)
        rows.append({
            "sparsifier": name,
            "synchronize_cpu_ms": 1e3 * statistics.median(r[name]["cpu"] for r in ranks),
            "synchronize_wall_ms": 1e3 * statistics.median(r[name]["wall"] for r in ranks),
            "cpu_ratio": cpu,
            "wall_ratio": wall,
        })  # fmt: skip

    def medians(*names: str) -> dict[str, float]:
        return {
            f"{name}_{clock}_ms": 1e3 * statistics.median(r[name][clock] for r in ranks)
            for name in names
            for clock in ("cpu", "wall")
        }

    return {"config": asdict(config), "dense": medians("all_reduce"),
            "rounds": medians("index_round", "value_round"), "rows": rows,
            "per_rank": ranks}  # fmt: skip


def _rank(rank: int, config: LoopbackConfig, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=config.ranks
    )
    layout = model_layout(config.numel)
    generator = torch.Generator().manual_seed(rank)
    gradient = synthetic_gradient(layout, generator)
    flat = gradient.clone()
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in layout.shapes]
    fresh = [g.view(shape).clone() for g, shape in zip(gradient.split(list(layout.sizes)),
                                                        layout.shapes)]  # fmt: skip
    reducers = {}
    for name, options in config.variants.items():
        options = dict(options)
        sparsifier = options.pop("sparsifier", "micro")
        reducers[name] = GradientReducer(params, sparsifier, config.density, **options)

    def all_reduce() -> None:
        dist.all_reduce(flat)

    def synchronize(reducer: GradientReducer) -> Any:
        def step() -> None:
            reducer.synchronize()

        return step

    works = {"all_reduce": all_reduce, **{n: synchronize(r) for n, r in reducers.items()}}
    samples: dict[str, dict[str, list[float]]] = {n: {"cpu": [], "wall": []} for n in works}
    for round_index in range(config.warmup + config.repeats):
        if round_index == config.warmup:  # the first variant's step sizes are known now
            reducer = next(iter(reducers.values()))
            assert reducer.last_step is not None
            works.update(_bare_rounds(reducer.last_step, reducer))
            samples.update({n: {"cpu": [], "wall": []} for n in ("index_round", "value_round")})
        for name, work in works.items():
            for p, g in zip(params, fresh):
                p.grad = g
            flat.copy_(gradient)
            dist.barrier()
            cpu, wall = time.process_time(), time.perf_counter()
            work()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            if round_index >= config.warmup:
                samples[name]["cpu"].append(cpu)
                samples[name]["wall"].append(wall)
    medians = {
        name: {clock: statistics.median(values) for clock, values in clocks.items()}
        for name, clocks in samples.items()
    }
    gathered: list[Any] = [None] * config.ranks
    dist.all_gather_object(gathered, medians)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        torch.save(gathered, out)
    leave_process(0)  # gloo's threads can abort a finished rank's teardown


def _bare_rounds(stats: StepStats, reducer: GradientReducer) -> dict[str, Any]:
    """The index all-gather and the value all-reduce of a step like ``stats``, alone, in
    the dtypes ``reducer`` sends (its framing's values where it names no value_dtype)."""
    comm = ProcessGroupCollectives()
    dtype = index_dtype(stats.numel)
    width = torch.empty(0, dtype=dtype).element_size()
    (_, size), *_ = FRAMINGS[stats.exchange].collectives(stats.max_local_selected, width)
    message = torch.zeros(int(size) // width, dtype=dtype)
    named = reducer.sparse_options.value_dtype
    wire = named or reducer.sparsifier.framing().value_dtype or torch.float32
    # a fixed union all-reduces every rank's slots, repeats included
    slots = stats.world_size * stats.max_local_selected
    values = torch.zeros(slots if stats.exchange == "fixed_union" else stats.selected, dtype=wire)

    def index_round() -> None:
        comm.run(Collective("all_gather", message, "indices"))

    def value_round() -> None:
        comm.run(Collective("all_reduce", values, "values"))

    return {"index_round": index_round, "value_round": value_round}


if __name__ == "__main__":  # python -m microsparse_lab.bench.loopback [numel] [repeats] [names]
    import json
    import sys

    arguments = [int(a) for a in sys.argv[1:3]]
    numel, repeats = (arguments + [RESNET18_NUMEL, 15][len(arguments) :])[:2]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else None  # e.g. micro,oracle
    variants = {n: {"sparsifier": n} for n in names} if names else LoopbackConfig().variants
    result = run(LoopbackConfig(numel=numel, repeats=repeats, variants=variants))
    print(json.dumps({k: v for k, v in result.items() if k != "per_rank"}, indent=1))
