"""Host syncs per steady-state step of every sparsifier, in both drivers, counted on the CPU.

Two gloo ranks on this machine train a small MLP (75,658 parameters, 16 rows a step, SGD)
with each sparsifier at density 0.01: once through ``GradientReducer`` (the loop API, one
slab) and once through the DDP hook on DDP's 5 buckets of 0.05 MB. After 4 warm-up steps
(DDP rebuilds its buckets after the first; the first step after a start reads its guard on
purpose) the operations that would make a GPU's host wait are counted over 3 steps on every
thread (:func:`~microsparse_lab.bench.syncs.count_host_syncs`) and printed per step, by name,
with the ATen operators that would launch a kernel on a GPU (views left out), the whole
training step's, beside stock DDP's for the same step.

Run: ``OMP_NUM_THREADS=1 python -m microsparse_lab.bench.syncs_table``.
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import microsparse
import microsparse.ddp
from microsparse_lab.bench.syncs import HostSyncs, count_host_syncs
from microsparse_lab.training.launch import leave_process

CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("dense", {}),
    ("micro", {}),
    ("micro", {"wire": "plain"}),
    ("micro", {"value_dtype": torch.bfloat16}),
    ("micro", {"selection": "threshold"}),
    ("micro", {"selection": "threshold", "threshold_rule": "as_coded",
               "partitioning": "contiguous", "index_message": "padded"}),
    ("topk", {}),
    ("topk", {"wire": "fixed"}),
    ("cltk", {}),
    ("deft", {}),
    ("hard_threshold", {}),
    ("sage", {}),
    ("oracle", {}),
)  # fmt: skip
"""(sparsifier, options) in the order printed: MiCRO's reference option set among them."""
DENSITY = 0.01  # k = 757 of the model's 75,658 entries, about 83 in the smallest bucket
WARMUP = 4  # DDP rebuilds its buckets after the first step; the first step may check things
COUNTED = 3
BUCKET_CAP_MB = 0.05  # 13,107 floats: 5 buckets once rebuilt


def model() -> nn.Module:
    """The MLP every count uses: 75,658 parameters, 5 DDP buckets of :data:`BUCKET_CAP_MB`."""
    torch.manual_seed(0)
    widths = [64, 128, 128, 128, 128, 128]
    layers = [m for a, b in itertools.pairwise(widths) for m in (nn.Linear(a, b), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(widths[-1], 10))


def training_step(
    net: nn.Module, rank: int, after_backward: Callable[[], object] = lambda: None
) -> Callable[[], None]:
    """One SGD step per call, on this rank's next batch (all drawn up front: no host work)."""
    generator = torch.Generator().manual_seed(rank)
    batches = itertools.cycle([torch.randn(16, 64, generator=generator) for _ in range(4)])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad()
        net(next(batches)).pow(2).mean().backward()
        after_backward()
        optimizer.step()

    return step


def steady_syncs(
    step: Callable[[], None], before_counting: Callable[[], None] = lambda: None
) -> HostSyncs:
    """Host syncs per step, counted over :data:`COUNTED` steps after :data:`WARMUP`."""
    for _ in range(WARMUP):
        step()
    before_counting()
    return count_host_syncs(step, repeats=COUNTED)


def measure(rank: int, cases: Sequence[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each case's syncs per step through the loop API and the hook, after stock DDP's
    (every rank must call it, after ``init_process_group``)."""
    stock = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=BUCKET_CAP_MB)
    rows = [{"sparsifier": "stock DDP", "options": {}, "loop": None,
             "hook": steady_syncs(training_step(stock, rank))}]  # fmt: skip
    for name, options in cases:
        net = model()
        reducer = microsparse.GradientReducer(net.named_parameters(), name, DENSITY, **options)
        loop = steady_syncs(training_step(net, rank, reducer.synchronize))
        ddp = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=BUCKET_CAP_MB)
        state = microsparse.ddp.SparseState(name, DENSITY, **options)
        ddp.register_comm_hook(state, microsparse.ddp.sparse_hook)
        hook = steady_syncs(training_step(ddp, rank))
        rows.append({"sparsifier": name, "options": options, "loop": loop, "hook": hook})
    return rows


def _label(row: dict[str, Any]) -> str:
    options = ", ".join(f"{key}={value!r}" for key, value in row["options"].items())
    return f"{row['sparsifier']}({options})" if options else row["sparsifier"]


def _names(syncs: HostSyncs) -> str:
    return ", ".join(f"{name} {count:.3g}" for name, count in syncs.counts.items()) or "-"


def _worker(rank: int, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    rows = measure(rank, CASES)
    dist.barrier()
    if rank == 0:
        print("| sparsifier | loop API | DDP hook (5 buckets) | what, in the hook | operators "
              "a step, loop / hook |")  # fmt: skip
        print("|---|---:|---:|---|---:|")
        for row in rows:
            loop, hook = row["loop"], row["hook"]
            syncs = "-" if loop is None else f"{loop.total:.3g}"
            operators = "-" if loop is None else f"{loop.operators:.0f}"
            print(f"| `{_label(row)}` | {syncs} | {hook.total:.3g} | {_names(hook)} | "
                  f"{operators} / {hook.operators:.0f} |")  # fmt: skip
    dist.destroy_process_group()
    leave_process(0)  # gloo's threads can abort a finished rank's teardown


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_worker, args=(os.path.join(directory, "init"),), nprocs=2)


if __name__ == "__main__":
    if sys.argv[1:]:
        sys.exit(f"usage: python -m microsparse_lab.bench.syncs_table (no arguments); got "
                 f"{' '.join(sys.argv[1:])}")  # fmt: skip
    main()
