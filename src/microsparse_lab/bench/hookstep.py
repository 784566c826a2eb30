"""The DDP hook's backward pass against stock DDP's, on gloo ranks over loopback.

Times ``loss.backward()`` under DDP (where the hook runs) for stock DDP (a dense all-reduce
of the same gradient), DDP with a hook that sends nothing (``none@ddp``: DDP's own cost),
MiCRO's hook on DDP's buckets and with ``one_exchange=True``, each also with DDP's
``gradient_as_bucket_view=True`` ("views": the gradients live in DDP's buckets, which saves
DDP a copy of every gradient into its bucket and back), and with each bucket's step started
on the hook's own thread (``own_thread=True``, the default on a GPU): medians after 3
warm-up steps, interleaved step by step, as ratios to stock DDP in the same run. The model is
6 × Linear(1365, 1365) (d = 11.2 M, ResNet-18's size; ``--layers``, ``--width``), 4 rows a
step (``--rows``), gradients set to None after every step as an optimizer's ``zero_grad``
does, one thread a rank. ``--bucket-cap-mb`` sets DDP's bucket size for every model: the
hook's step has a fixed cost per bucket (its collective rounds one after another, its
kernels), so the number of buckets matters.

Run: ``OMP_NUM_THREADS=1 python -m microsparse_lab.bench.hookstep [RANKS] [STEPS]
[--bucket-cap-mb MB] [--width W] [--layers L] [--rows R]`` (default 2, 20, DDP's 25, 1365,
6, 4).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import microsparse.ddp as mddp
from microsparse_lab import arguments
from microsparse_lab.methods.hooks import unchanged_hook
from microsparse_lab.training.launch import leave_process

FLOOR = "floor"
CONFIGS: dict[str, tuple[object, bool]] = {  # name: (the hook's options, or None, or FLOOR; views)
    "stock DDP": (None, False),
    "stock DDP, views": (None, True),
    "none@ddp": (FLOOR, False),
    "none@ddp, views": (FLOOR, True),
    "micro@ddp": ({}, False),
    "micro@ddp, views": ({}, True),
    "micro@ddp, own thread": ({"own_thread": True}, False),
    "micro@ddp(exchange=one)": ({"one_exchange": True}, False),
    "micro@ddp(exchange=one), views": ({"one_exchange": True}, True),
}
WARMUP = 3


def _worker(rank: int, ranks: int, init: str, steps: int, bucket_cap_mb: float, width: int,
            layers: int, rows: int) -> None:  # fmt: skip
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=ranks)
    models = {}
    for name, (options, views) in CONFIGS.items():
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        ddp = DistributedDataParallel(net, gradient_as_bucket_view=views,
                                      bucket_cap_mb=bucket_cap_mb)  # fmt: skip
        if options == FLOOR:
            ddp.register_comm_hook(None, unchanged_hook)
        elif isinstance(options, dict):
            ddp.register_comm_hook(mddp.SparseState("micro", 0.001, **options), mddp.sparse_hook)
        models[name] = ddp
    x = torch.randn(rows, width)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(WARMUP + steps):
        for name, model in models.items():
            loss = model(x).square().mean()
            dist.barrier()  # every rank starts the pass together
            started = time.perf_counter()
            loss.backward()
            times[name].append(time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
    dist.barrier()
    if rank == 0:
        buckets = models["stock DDP"]._get_ddp_logging_data().get("num_buckets_reduced")
        print(f"DDP buckets of {bucket_cap_mb:g} MB: {buckets} a pass")
        medians = {name: statistics.median(t[WARMUP:]) * 1000 for name, t in times.items()}
        for name, ms in medians.items():
            print(f"{name:>32}: {ms:6.1f} ms  ({ms / medians['stock DDP']:.2f}x stock DDP)")
    dist.destroy_process_group()
    leave_process(0)  # gloo's threads can abort a finished rank's teardown


def main(argv: list[str]) -> None:
    """Parse ``[RANKS] [STEPS]`` (``--help`` describes them), run the ranks and print the
    medians."""
    parser = argparse.ArgumentParser(
        prog="python -m microsparse_lab.bench.hookstep",
        description=(__doc__ or "").split("\n\n")[0],
    )
    add = parser.add_argument
    add("ranks", nargs="?", type=arguments.positive_int, default=2,
        help="gloo ranks on this machine (default: %(default)s)")  # fmt: skip
    add("steps", nargs="?", type=arguments.positive_int, default=20,
        help=f"timed steps after {WARMUP} warm-up steps (default: %(default)s)")  # fmt: skip
    add("--bucket-cap-mb", metavar="MB", type=arguments.positive_float, default=25.0,
        help="DDP's bucket_cap_mb for every model (default: DDP's %(default)s)")  # fmt: skip
    add("--width", type=arguments.positive_int, default=1365,
        help="the Linear layers' width (default: %(default)s)")  # fmt: skip
    add("--layers", type=arguments.positive_int, default=6,
        help="Linear layers (default: %(default)s; d = layers × width × (width + 1))")  # fmt: skip
    add("--rows", type=arguments.positive_int, default=4,
        help="rows of the batch, which set backward's work (default: %(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        init = os.path.join(directory, "init")
        spawned = (args.ranks, init, args.steps, args.bucket_cap_mb, args.width, args.layers,
                   args.rows)  # fmt: skip
        mp.spawn(_worker, args=spawned, nprocs=args.ranks)


if __name__ == "__main__":
    main(sys.argv[1:])
